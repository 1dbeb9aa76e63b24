"""Multi-turn trajectories through ring attention (issue 40, "it composes"): a group of
trajectories packed for the update (observations in, the loss on the model's tokens), with and
without the shared-prompt layout, takes the same step with `model.attention="ring"` over a
mesh of fsdp 2 x seq 4 as with dense attention on one device: loss, metrics, per-token
log-probs and parameter gradients (fp32)."""
import jax
import numpy as np
import pytest

from lrl import grpo
from lrl.mesh import make_mesh
from lrl.rl import LossConfig
from tests.test_multiturn_train import _groups, _setup
from tests.test_shared_prompt import _step, _tiny


@pytest.mark.parametrize("shared", ["off", pytest.param("on", marks=pytest.mark.slow)])
def test_a_trajectory_groups_update_under_ring_attention_equals_dense(shared):
    s = _setup(shared_prompt=shared)
    rows, _, _ = grpo.pack(s, _groups(), np.array([[1.0, -1.0]], np.float32), np.ones(2),
                           np.arange(2))
    assert rows["loss_mask"].sum() == sum(m.sum() for m in _groups().masks)
    assert rows.get("prefix_ids", np.zeros(1)).any() == (shared == "on")
    # a padding row beside it: the batch splits over fsdp 2
    rows = {k: np.concatenate([v, np.zeros_like(v)]) for k, v in rows.items()}
    loss = LossConfig(aggregation="token_mean", entropy_coef=0.01)
    d0, m0, lp0 = _step(_tiny(vocab_size=64), loss, rows)
    d1, m1, lp1 = _step(_tiny(vocab_size=64, attention="ring"), loss, rows,
                        mesh=make_mesh({"fsdp": 2, "seq": 4}))
    on = rows["segment_ids"] > 0
    np.testing.assert_allclose(lp1[on], lp0[on], rtol=1e-5, atol=1e-5)
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(d0)) > 1e-3   # it moved
    for a, b in zip(jax.tree.leaves(d1), jax.tree.leaves(d0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
