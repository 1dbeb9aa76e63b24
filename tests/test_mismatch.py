"""Sampler-trainer mismatch metrics against numbers worked out by hand; sums over batches
combine exactly; a bf16 sampler against the fp32 trainer shows a small nonzero mismatch and
the same numerics show none."""
import jax
import jax.numpy as jnp
import numpy as np

from lrl import models, rollout
from lrl.data import packing
from lrl.rl import mismatch
from lrl.rl import update as upd

L3, L4 = np.log(3.0), np.log(4.0)
EDGES = (0, 2, 4)   # buckets [0, 2), [2, 4), [4, inf)


def _case():
    """Two rows; Δ = trainer - sampler per completion token, a prompt position masked out
    (its sampler value -inf, as padding may hold)."""
    #               pos 0  pos 1  pos 2  pos 3  pos 4   masked
    d = np.array([[0.1, -0.2, L3, 0.0, -L4, 0.0],
                  [0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]], np.float32)
    pos = np.array([[0, 1, 2, 3, 4, 0], [0, 0, 0, 0, 0, 0]])
    sampler = np.where(mask > 0, -2.0, -np.inf)
    return sampler + d, sampler, mask, pos


def test_metrics_by_hand():
    m = mismatch.mismatch_metrics(*_case(), edges=EDGES)
    want = {
        # [0, 2): Δ = 0.1, -0.2, 0.5. k3 = e^Δ - 1 - Δ: 0.0051709, 0.0187308, 0.1487213.
        "mismatch/pos_0_2/tokens": 3, "mismatch/pos_0_2/abs_mean": 0.8 / 3,
        "mismatch/pos_0_2/abs_max": 0.5, "mismatch/pos_0_2/k1": -0.4 / 3,
        "mismatch/pos_0_2/k3": 0.1726230 / 3, "mismatch/pos_0_2/outside_frac": 0.0,
        # [2, 4): Δ = log 3 (ratio 3: outside [0.5, 2]), 0. k3 = 3 - 1 - log 3 = 0.9013877.
        "mismatch/pos_2_4/tokens": 2, "mismatch/pos_2_4/abs_mean": L3 / 2,
        "mismatch/pos_2_4/abs_max": L3, "mismatch/pos_2_4/k1": -L3 / 2,
        "mismatch/pos_2_4/k3": 0.9013877 / 2, "mismatch/pos_2_4/outside_frac": 0.5,
        # [4, inf): Δ = -log 4 (ratio 1/4: outside). k3 = 1/4 - 1 + log 4 = 0.6362944.
        "mismatch/pos_4_inf/tokens": 1, "mismatch/pos_4_inf/abs_mean": L4,
        "mismatch/pos_4_inf/abs_max": L4, "mismatch/pos_4_inf/k1": L4,
        "mismatch/pos_4_inf/k3": 0.6362944, "mismatch/pos_4_inf/outside_frac": 1.0,
        # all six tokens
        "mismatch/tokens": 6, "mismatch/abs_mean": (0.8 + L3 + L4) / 6,
        "mismatch/abs_max": L4, "mismatch/k1": (-0.4 - L3 + L4) / 6,
        "mismatch/k3": (0.1726230 + 0.9013877 + 0.6362944) / 6,
        "mismatch/outside_frac": 2 / 6,
    }
    assert sorted(m) == sorted(want)
    for k, v in want.items():
        np.testing.assert_allclose(m[k], v, rtol=2e-6, atol=1e-7, err_msg=k)


def test_sums_of_batches_combine_to_the_whole_and_empty_buckets_are_left_out():
    t, s, mask, pos = _case()
    whole = mismatch.mismatch_sums(t, s, mask, pos, edges=EDGES)
    parts = [mismatch.mismatch_sums(t[r:r + 1], s[r:r + 1], mask[r:r + 1], pos[r:r + 1],
                                    edges=EDGES) for r in range(2)]
    both = mismatch.combine_sums(*parts)
    for k in whole:
        np.testing.assert_allclose(both[k], whole[k], rtol=1e-6, err_msg=k)
    # Row 1 alone has one token at position 0: only the first bucket is reported.
    one = mismatch.finalize(parts[1], EDGES)
    assert not any(k.startswith(("mismatch/pos_2_4", "mismatch/pos_4_inf")) for k in one)
    np.testing.assert_allclose(one["mismatch/pos_0_2/abs_mean"], 0.5, rtol=1e-6)
    # Nothing measured: only the token count.
    assert mismatch.finalize(mismatch.mismatch_sums(t, s, 0 * mask, pos)) == {
        "mismatch/tokens": 0.0}
    assert mismatch.bucket_names() == ["0_256", "256_1k", "1k_4k", "4k_inf"]


CFG = models.tiny_config(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=16, mlp_dim=128, remat="none")


def _sampled_vs_trainer(sampler_cfg):
    """Samples from `sampler_cfg` (the rollout engine), scored by the fp32 trainer forward
    (`lrl.rl.update.logprobs` on packed rows) -> the mismatch metrics."""
    params = models.init_params(CFG, jax.random.key(0))
    # Scaled up so that the logits are far from uniform (as a trained model's are).
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, CFG.vocab_size, n).astype(np.int32) for n in (5, 9, 3)]
    outs = rollout.generate(sampler_cfg, params, prompts, max_new_tokens=12, num_samples=4,
                            temperature=1.0, seed=3, page_size=4, max_slots=8)
    ps = [p for p, per in zip(prompts, outs) for _ in per]
    comps = [np.asarray(t) for per in outs for t, _ in per]
    logps = [np.asarray(lp) for per in outs for _, lp in per]
    rows, _ = packing.pack(ps, comps, 64, token_values={
        "rollout_logp": logps, "response_pos": [np.arange(1, len(c) + 1) for c in comps]})
    batch = {k: jnp.asarray(rows[k]) for k in ("tokens", "positions", "segment_ids", "targets")}
    trainer = upd.logprobs(params, batch, model_cfg=CFG, chunk=16)
    pos = rows["response_pos"]
    return mismatch.mismatch_metrics(trainer, rows["rollout_logp"], pos > 0, pos - 1), len(
        np.concatenate(comps))


def test_bf16_sampler_against_the_fp32_trainer_shows_a_small_mismatch():
    same, n = _sampled_vs_trainer(CFG)
    assert same["mismatch/tokens"] == n == 12 * 12
    assert same["mismatch/abs_max"] < 1e-4 and abs(same["mismatch/k3"]) < 1e-8
    assert same["mismatch/outside_frac"] == 0.0
    bf16, _ = _sampled_vs_trainer(CFG.replace(dtype=jnp.bfloat16))
    assert bf16["mismatch/tokens"] == n
    # Measured here: fp32 |Δ| mean 3.3e-7, max 1.4e-6; bf16 |Δ| mean 6.0e-3, max 3.3e-2,
    # k3 3.6e-5, no ratio outside [0.5, 2]: small, nonzero, far from a different policy's.
    assert 1e-3 < bf16["mismatch/abs_mean"] < 0.05, bf16
    assert bf16["mismatch/abs_max"] > 100 * same["mismatch/abs_max"]
    assert 0.0 < bf16["mismatch/k3"] < 1e-3
    assert bf16["mismatch/outside_frac"] == 0.0
