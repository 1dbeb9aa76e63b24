"""Golden metrics of one GRPO learning half (`grpo.learn`) on a tiny fixed-seed setup: what
the step's advantages, packing, trainer old log-probs, mismatch metrics, two minibatches of
clipped updates and their metrics come to, pinned to the numbers this code gave. As nanodo
pins one train step, this is the fast tier's tripwire for a change that moves a step's numbers
anywhere between the rewards and the new parameters; a change meant to move them updates the
numbers here and says why in its commit.

Recorded at commit 29e2cbe (jax 0.10.2, CPU, float32, matmul precision "highest")."""
import dataclasses

import jax
import numpy as np

from lrl import grpo, models, step_setup
from lrl.groups import Groups
from lrl.rl import update as upd
from lrl.tasks import Prompt
from tests.test_grpo_step import TINY, _mismatch_setup, _rl, _update_programs

# Measured at 29e2cbe with the inputs below.
GOLDEN = {
    "advantage/abs_mean": 0.5303291082382202,
    "loss": 0.20605241,
    "pg_loss": 0.20605241,
    "grad_norm": 0.90339327,
    "update_norm": 0.45169663,
    "entropy": 4.149918,
    "ratio_mean": 1.0104785,
    "ratio_min": 0.5454163,
    "ratio_max": 1.2637656,
    "mismatch/abs_mean": 0.5347602113764337,
    "mismatch/k3": 0.12535673506716463,
    "mismatch/outside_frac": 0.1276595744680851,
    "pack/fill": 0.7421875,
}
EXACT = {"pack/tokens": 95, "pack/micro_batches": 2, "mismatch/tokens": 47,
         "mismatch/micro_batches": 2, "pack/truncated": 0}
PARAM_ABS_SUM = 524.9445190429688


def _inputs():
    """Four prompts x two samples with hand-set rewards; sampled tokens and sampler log-probs
    from a seeded generator (no rollout: the engine has its own tests)."""
    rng = np.random.RandomState(0)
    prompts = tuple(Prompt(rng.randint(1, 64, n).astype(np.int32), "", {}, "")
                    for n in (5, 9, 3, 7))
    lengths = [6, 8, 3, 8, 5, 7, 8, 2]
    completions = tuple(rng.randint(1, 64, n).astype(np.int32) for n in lengths)
    logps = tuple((-3.5 - 0.3 * rng.rand(n)).astype(np.float32) for n in lengths)
    rewards_PG = np.array([[1., 0.], [0.5, 0.], [1., 1.], [0., 1.]], np.float32)
    return Groups(prompts, completions, logps, 2, np.array([n >= 8 for n in lengths]),
                  texts=("",) * 8, rewards_PG=rewards_PG)


def test_one_learn_step_gives_the_recorded_metrics():
    u, tx = _update_programs(lr=0.5)
    # Old log-probs from a trainer forward (so the sampler's feed only the mismatch metrics)
    # and two minibatches (so the second one's ratios leave 1).
    s = dataclasses.replace(_mismatch_setup(rows_per_shard=2), update=u, rl=_rl(
        loss=dict(clip_low=0.2, clip_high=0.28, dual_clip=0.0, ratio_level="token",
                  aggregation="seq_mean_token_mean", kl_coef=0.0, entropy_coef=0.0,
                  tis_cap=0.0, mask_level="none", staleness_decay=1.0, max_staleness=-1),
        # every option learn() reads, set here, so a new default elsewhere moves nothing
        prompts_per_step=4, group_size=4, max_new_tokens=8, estimator="grpo", epochs=1,
        minibatches=2, recompute_old_logp=True, fused_head=True, overlong="none",
        mismatch_fraction=1.0, shared_prompt="off", logprob_chunk=1024,
        max_tokens_per_micro=4096, row_len=512))
    state = upd.init_train_state(models.init_params(TINY, jax.random.key(0)), tx)
    state, m = grpo.learn(s, step_setup.Live(), state, _inputs(), {})
    for k, want in GOLDEN.items():
        np.testing.assert_allclose(float(m[k]), want, rtol=2e-4, err_msg=k)
    for k, want in EXACT.items():
        assert m[k] == want, (k, m[k])
    got = sum(float(np.abs(np.asarray(x)).sum()) for x in jax.tree.leaves(state.params))
    np.testing.assert_allclose(got, PARAM_ABS_SUM, rtol=1e-5)
