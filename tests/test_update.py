"""The policy-update step: micro-batch accumulation and sharding leave it unchanged, the
forward-only log-probs match the model, and a tiny policy learns a two-armed bandit."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lrl import mesh as mesh_lib
from lrl import models
from lrl.data.packing import pack
from lrl.rl import LossConfig, advantages, optim
from lrl.rl import update as upd

CFG = models.tiny_config(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, mlp_dim=64)


def _batch(seed=0, rows=4, row_len=16, with_old=True, with_age=False):
    """Random prompts and completions packed into rows, with per-sequence advantages and
    old / reference / rollout log-probs near the model's own (and sample ages 0-2)."""
    rng = np.random.default_rng(seed)
    n = 7
    prompts = [rng.integers(1, CFG.vocab_size, rng.integers(2, 5)) for _ in range(n)]
    comps = [rng.integers(1, CFG.vocab_size, rng.integers(2, 6)) for _ in range(n)]
    tok = {k: [rng.normal(-3.4, 0.2, len(c)) for c in comps]
           for k in (("old_logp",) if with_old else ()) + ("ref_logp", "rollout_logp")}
    seq = {"advantages": rng.normal(size=n)}
    if with_age:
        seq["sample_age"] = np.arange(n) % 3
    batch, _ = pack(prompts, comps, row_len, seq_values=seq,
                    token_values=tok, min_rows=rows, rows_multiple=rows)
    assert batch["tokens"].shape == (rows, row_len)
    return {k: jnp.asarray(v) for k, v in batch.items()}


_PARAMS = []


def _params():
    if not _PARAMS:  # one init for the whole file
        _PARAMS.append(models.init_params(CFG, jax.random.key(0)))
    return _PARAMS[0]


def _state(params, tx):
    return upd.init_train_state(jax.tree.map(jnp.array, params), tx)  # fresh copies: donated


LOSS = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="seq_mean_token_mean",
                  kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)


def _assert_trees_close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


_REFERENCE = {}


def _reference(fused_head: bool = True):
    """The one-big-batch, single-device step (SGD with rate 1: the parameter change is minus
    the gradient itself) that accumulation and sharding must reproduce."""
    if fused_head not in _REFERENCE:
        tx = optax.sgd(1.0)
        _REFERENCE[fused_head] = upd.make_update_fn(CFG, LOSS, tx, num_micro=1, chunk=4,
                                                    fused_head=fused_head)(
            _state(_params(), tx), _batch())
    return _REFERENCE[fused_head]


def test_micro_batches_equal_one_batch():
    # tests/test_losses.py checks every aggregation and ratio level; this checks the scan.
    tx = optax.sgd(1.0)
    params, batch = _params(), _batch()
    one, m1 = _reference()
    four, m4 = upd.make_update_fn(CFG, LOSS, tx, num_micro=4, chunk=4)(_state(params, tx),
                                                                      batch)
    delta = jax.tree.map(lambda a, b: a - b, one.params, params)
    assert max(float(jnp.abs(d).max()) for d in jax.tree.leaves(delta)) > 1e-4  # it moved
    _assert_trees_close(one.params, four.params, rtol=1e-5, atol=1e-7)
    for k in m1:
        np.testing.assert_allclose(m1[k], m4[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert float(m1["tokens"]) == float(batch["loss_mask"].sum())
    assert int(one.step) == 1 and float(m1["kl"]) > 0 and float(m1["entropy"]) > 0


@pytest.mark.parametrize("fused_head", [False, True])
def test_micro_batches_equal_one_batch_with_sequence_level_corrections(fused_head):
    """Sequence-level IS and a geometric-mean sequence mask read whole sequences; a sequence
    lies within one row, so micro-batching leaves the step unchanged."""
    loss = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="seq_mean_token_mean",
                      tis_cap=1.5, tis_level="sequence", mask_level="geometric",
                      mask_low=0.9, mask_high=1.1, staleness_decay=0.5, max_staleness=1)
    tx = optax.sgd(1.0)
    params, batch = _params(), _batch(with_age=True)
    fn = lambda k: upd.make_update_fn(CFG, loss, tx, num_micro=k, chunk=4,  # noqa: E731
                                      fused_head=fused_head)
    one, m1 = fn(1)(_state(params, tx), batch)
    four, m4 = fn(4)(_state(params, tx), batch)
    _assert_trees_close(one.params, four.params, rtol=1e-5, atol=1e-7)
    for k in m1:
        np.testing.assert_allclose(m1[k], m4[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert 0 < float(m1["masked_seq_frac"]) < 1, m1["masked_seq_frac"]
    assert 0 < float(m1["staleness_weight_mean"]) < 1 and float(m1["tis_weight_mean"]) != 1
    delta = jax.tree.map(lambda a, b: a - b, one.params, params)
    assert max(float(jnp.abs(d).max()) for d in jax.tree.leaves(delta)) > 1e-4  # it moved


def test_sharded_step_equals_single_device():
    tx = optax.sgd(1.0)
    want, wm = _reference()
    mesh = mesh_lib.make_mesh({"fsdp": 2, "seq": 4})
    sh = upd.train_state_shardings(CFG, tx, mesh)
    state = jax.device_put(_state(_params(), tx), sh)
    fn = upd.make_update_fn(CFG, LOSS, tx, mesh, num_micro=2, chunk=8)
    got, gm = fn(state, jax.device_put(_batch(), mesh_lib.batch_sharding(mesh, 2)))
    q = got.params["layers"]["q_proj"]["kernel"]
    assert q.sharding.spec == sh.params["layers"]["q_proj"]["kernel"].spec
    assert "fsdp" in str(q.sharding.spec)
    _assert_trees_close(got.params, want.params, rtol=1e-4, atol=1e-6)
    for k in wm:
        np.testing.assert_allclose(gm[k], wm[k], rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("mesh_axes,num_micro", [(None, 1), ({"fsdp": 2, "seq": 4}, 2)])
def test_fused_head_step_equals_the_unfused_step(mesh_axes, num_micro):
    """The loss's gradient formed in the lm head's forward pass (lrl.rl.fused_head) gives the
    same step and metrics as the chunked log-probs differentiated by jax, sharded too."""
    tx = optax.sgd(1.0)
    want, wm = _reference(fused_head=False)
    state, batch = _state(_params(), tx), _batch()
    mesh = None
    if mesh_axes:
        mesh = mesh_lib.make_mesh(mesh_axes)
        state = jax.device_put(state, upd.train_state_shardings(CFG, tx, mesh))
        batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh, 2))
    got, gm = upd.make_update_fn(CFG, LOSS, tx, mesh, num_micro=num_micro, chunk=4,
                                 fused_head=True)(state, batch)
    _assert_trees_close(got.params, want.params, rtol=1e-4, atol=1e-6)
    for k in wm:
        np.testing.assert_allclose(gm[k], wm[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_parameters_sharded_over_fsdp_and_seq_give_the_same_step():
    """param_shard_axes=("fsdp", "seq"): the seq devices shard parameters and optimizer state
    too (ZeRO-3 over fsdp x seq); the step is unchanged."""
    cfg = CFG.replace(param_shard_axes=("fsdp", "seq"))
    tx = optax.sgd(1.0)
    want, wm = _reference()
    mesh = mesh_lib.make_mesh({"fsdp": 2, "seq": 4})
    sh = upd.train_state_shardings(cfg, tx, mesh)
    spec = sh.params["layers"]["q_proj"]["kernel"].spec
    assert "fsdp" in str(spec) and "seq" in str(spec), spec
    state = jax.device_put(_state(_params(), tx), sh)
    got, gm = upd.make_update_fn(cfg, LOSS, tx, mesh, num_micro=2, chunk=8)(
        state, jax.device_put(_batch(), mesh_lib.batch_sharding(mesh, 2)))
    assert got.params["layers"]["q_proj"]["kernel"].sharding.spec == spec
    _assert_trees_close(got.params, want.params, rtol=1e-4, atol=1e-6)
    for k in wm:
        np.testing.assert_allclose(gm[k], wm[k], rtol=1e-4, atol=1e-6, err_msg=k)
    with pytest.raises(ValueError, match="param_shard_axes"):
        CFG.replace(param_shard_axes=("tensor",))


def test_lr_schedule_and_decay_mask():
    s = optim.lr_schedule(1.0, warmup_steps=4, total_steps=12, end_lr_ratio=0.1)
    # Warm-up (k+1)/4; then 0.1 + 0.9·½(1 + cos(π·(k-4)/8)); constant 0.1 after step 12.
    want = [0.25, 0.5, 0.75, 1.0, 1.0, 0.1 + 0.45 * (1 + np.cos(np.pi / 8)), 0.55, 0.1, 0.1]
    got = [float(s(k)) for k in (0, 1, 2, 3, 4, 5, 8, 12, 20)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    mask = optim.default_decay_mask(_params())
    assert mask["layers"]["q_proj"]["kernel"] and mask["embed"]["embedding"]
    assert not mask["layers"]["input_norm"]["scale"] and not mask["final_norm"]["scale"]
    with pytest.raises(ValueError, match="total_steps"):
        optim.lr_schedule(1.0, warmup_steps=5, total_steps=3)


def test_adamw_bf16_step_sharded_init_and_metrics():
    # fp32 master weights, bf16 compute.
    cfg = CFG.replace(dtype=jnp.bfloat16)
    tx = optim.make_optimizer(lr=1e-3, warmup_steps=2, total_steps=10, weight_decay=0.01)
    mesh = mesh_lib.make_mesh({"fsdp": 4, "tensor": 2})
    state = upd.make_init_fn(cfg, tx, mesh)(jax.random.key(0))
    sh = upd.train_state_shardings(cfg, tx, mesh)
    for a, s in zip(jax.tree.leaves(state), jax.tree.leaves(sh)):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    fn = upd.make_update_fn(cfg, LOSS, tx, mesh, num_micro=2)
    batch = jax.device_put(_batch(2), mesh_lib.batch_sharding(mesh, 2))
    state, m = fn(state, batch)
    state, m2 = fn(state, batch)
    assert fn._cache_size() == 1  # compiled once
    np.testing.assert_allclose([m["learning_rate"], m2["learning_rate"]], [5e-4, 1e-3], rtol=1e-6)
    for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "update_norm", "clip_frac_low",
              "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max", "tokens", "sequences"):
        assert np.isfinite(float(m2[k])), k
    assert float(m2["update_norm"]) > 0 and int(state.step) == 2
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))


def test_logprobs_match_the_model():
    params, batch = _params(), _batch(3)
    logits = models.forward(CFG, params, batch["tokens"], batch["positions"],
                            batch["segment_ids"])
    want = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
    got = upd.make_logprobs_fn(CFG, num_micro=2, chunk=4)(params, batch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    mesh = mesh_lib.make_mesh({"fsdp": 2, "seq": 4})
    fn = upd.make_logprobs_fn(CFG, mesh, num_micro=2, chunk=8)
    got_s = fn(jax.device_put(params, models.param_shardings(CFG, mesh)),
               jax.device_put(batch, mesh_lib.batch_sharding(mesh, 2)))
    np.testing.assert_allclose(got_s, want, rtol=1e-5, atol=1e-5)


def test_two_armed_bandit_moves_to_the_rewarded_arm():
    # One context token (1); the policy answers with one token; only token 3 earns reward.
    cfg = models.tiny_config(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                             head_dim=8, mlp_dim=32)
    G, good = 16, 3
    tx = optim.make_optimizer(lr=0.03, warmup_steps=0, total_steps=100)
    state = upd.make_init_fn(cfg, tx)(jax.random.key(1))
    step = upd.make_update_fn(cfg, LossConfig(), tx)

    policy = jax.jit(lambda params: jax.nn.softmax(
        models.forward(cfg, params, jnp.array([[1]]))[0, 0]))

    def p_good(params):
        return float(policy(params)[good])

    start = p_good(state.params)
    rng = jax.random.key(2)
    const = lambda v: jnp.full((G, 2), v, jnp.int32)  # noqa: E731
    for _ in range(25):
        rng, k = jax.random.split(rng)
        answers = jax.random.categorical(k, jnp.log(policy(state.params)), shape=(G,))
        adv_G = advantages((answers == good)[None].astype(jnp.float32), "grpo")[0]
        batch = {"tokens": jnp.stack([const(1)[:, 0], answers], 1),
                 "positions": jnp.broadcast_to(jnp.arange(2), (G, 2)),
                 "segment_ids": const(1),
                 "targets": jnp.stack([answers, const(0)[:, 0]], 1),
                 "loss_mask": jnp.broadcast_to(jnp.array([1.0, 0.0]), (G, 2)),
                 "advantages": jnp.broadcast_to(adv_G[:, None], (G, 2))}
        state, m = step(state, batch)
        # No old_logp in the batch: on-policy, the ratio is exactly 1.
        assert float(m["ratio_min"]) == 1.0 == float(m["ratio_max"])
    end = p_good(state.params)
    assert start < 0.3 and end > 0.8, (start, end)


def test_bad_batches_name_the_culprit():
    tx = optax.sgd(1.0)
    batch = _batch()
    with pytest.raises(ValueError, match=r"missing \['advantages'\]"):
        upd.update_step(_state(_params(), tx), {k: v for k, v in batch.items()
                                                 if k != "advantages"},
                        model_cfg=CFG, loss_cfg=LOSS, tx=tx)
    with pytest.raises(ValueError, match="unknown keys \\['reward'\\]"):
        upd.update_step(_state(_params(), tx), {**batch, "reward": batch["advantages"]},
                        model_cfg=CFG, loss_cfg=LOSS, tx=tx)
    with pytest.raises(ValueError, match="num_micro=3"):
        upd.update_step(_state(_params(), tx), batch, model_cfg=CFG, loss_cfg=LOSS, tx=tx,
                        num_micro=3)


def test_bf16_masters_update_is_adamw_and_finite():
    """With bf16 masters the betas are not cast to bf16 (where 0.999 is 1.0 and Adam's bias
    correction divides by zero: every update was NaN): the update equals optax's AdamW in
    fp32 to bf16 precision."""
    p = {"w": jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16).reshape(4, 4)}
    g = {"w": jnp.linspace(0.5, -0.25, 16, dtype=jnp.bfloat16).reshape(4, 4)}
    tx = optim.make_optimizer(lr=1e-3, warmup_steps=0, total_steps=10, b2=0.999,
                              weight_decay=0.1, clip_norm=None)
    u, _ = tx.update(g, tx.init(p), p)
    ref = optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), p)
    want, _ = ref.update(jax.tree.map(lambda x: x.astype(jnp.float32), g), ref.init(p32), p32)
    assert bool(jnp.isfinite(u["w"]).all())
    np.testing.assert_allclose(np.asarray(u["w"], np.float32), np.asarray(want["w"]),
                               rtol=2e-2, atol=1e-5)
