"""The fused lm-head loss (gradient formed in the forward pass) against the unfused path:
chunked log-probs, then `packed_policy_loss`, differentiated by jax. Values and gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.rl import losses
from lrl.rl.fused_head import fused_token_loss
from lrl.rl.logprobs import token_logprobs_and_entropy

B, T, D, V, CHUNK = 2, 37, 8, 50, 16   # 37 = 3 chunks of 13: the last one padded


def _batch(seed=0):
    ks = jax.random.split(jax.random.key(seed), 9)
    h = jax.random.normal(ks[0], (B, T, D), jnp.float32)
    w = jax.random.normal(ks[1], (D, V), jnp.float32) * 0.7
    tgt = jax.random.randint(ks[2], (B, T), 0, V)
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 12 + [0] * 5], B, axis=0), jnp.int32)
    mask = (jax.random.uniform(ks[3], (B, T)) > 0.2).astype(jnp.float32)
    adv = jax.random.normal(ks[4], (B, T))
    base = jax.random.normal(ks[5], (B, T)) * 0.3 - 3.0
    # old / reference / rollout log-probs near the policy's, so that clipping happens both ways
    logp0, _ = token_logprobs_and_entropy(h, w, tgt, chunk=CHUNK)
    old = logp0 + jax.random.normal(ks[6], (B, T)) * 0.3
    ref = logp0 + jax.random.normal(ks[7], (B, T)) * 0.2
    return dict(h=h, w=w, tgt=tgt, seg=seg, mask=mask, adv=adv, old=old, ref=ref,
                rollout=old + base * 0.05,
                # a sampler within ±0.15 of old, for the masks; ages 0 and 2 by segment
                noisy=old + jax.random.normal(ks[8], (B, T)) * 0.15,
                age=jnp.where(seg == 2, 2.0, 0.0))


CASES = {
    "token_mean": dict(),
    "seq_mean_token_mean": dict(aggregation="seq_mean_token_mean"),
    "sum_norm": dict(aggregation="seq_mean_token_sum_norm", max_len=32),
    "clip_higher_dual": dict(clip_high=0.28, dual_clip=3.0),
    "kl_k1_entropy": dict(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01),
    "kl_k2": dict(kl_coef=0.05, kl_estimator="k2"),
    "kl_k3_tis": dict(kl_coef=0.05, tis_cap=2.0),
    "token_mask_stale": dict(kl_coef=0.05, entropy_coef=0.01, mask_level="token",
                             mask_low=0.9, mask_high=1.1, staleness_decay=0.5),
    "seq_tis_geo_mask": dict(kl_coef=0.05, tis_cap=1.5, tis_level="sequence",
                             mask_level="geometric", mask_low=0.95, mask_high=1.05,
                             max_staleness=1),
    "geo_tis_seq_mask": dict(aggregation="seq_mean_token_mean", tis_cap=1.05,
                             tis_level="geometric", mask_level="sequence", mask_low=0.5,
                             mask_high=1.5),
}


def _rollout_and_age(cfg, b):
    rollout = None
    if cfg.corrects_rollout:
        rollout = b["noisy"] if cfg.mask_level is not None else b["rollout"]
    return rollout, (b["age"] if cfg.weighs_staleness else None)


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_loss_equals_unfused_values_and_gradients(name, on_policy):
    cfg = losses.LossConfig(**CASES[name])
    b = _batch()
    denoms = losses.loss_denominators(b["mask"], b["seg"], cfg.max_len)
    old = None if on_policy else b["old"]
    ref = b["ref"] if cfg.kl_coef else None
    rollout, age = _rollout_and_age(cfg, b)
    if on_policy and cfg.corrects_sequences:   # needs old log-probs: see the test below
        pytest.skip("a sequence-level correction needs old log-probs in the fused pass")

    def unfused(h, w):
        logp, ent = token_logprobs_and_entropy(h, w, b["tgt"], chunk=CHUNK)
        if cfg.entropy_coef == 0.0:
            ent = jax.lax.stop_gradient(ent)
        old_ = jax.lax.stop_gradient(logp) if old is None else old
        return losses.packed_policy_loss(logp, old_, b["adv"], b["mask"], b["seg"], denoms, cfg,
                                         ref_logp_BT=ref, rollout_logp_BT=rollout, age_BT=age,
                                         entropy_BT=ent)

    def fused(h, w):
        aux = losses.token_loss_aux(b["mask"], b["seg"], denoms, cfg, adv_BT=b["adv"],
                                    old_logp_BT=old, ref_logp_BT=ref, rollout_logp_BT=rollout,
                                    age_BT=age)
        loss, logp, ent = fused_token_loss(h, w, b["tgt"],
                                           functools.partial(losses.token_loss, cfg=cfg), aux,
                                           chunk=CHUNK)
        return loss, (logp, ent)

    (l_u, m_u), g_u = jax.value_and_grad(unfused, argnums=(0, 1), has_aux=True)(b["h"], b["w"])
    (l_f, (logp, ent)), g_f = jax.jit(jax.value_and_grad(fused, argnums=(0, 1),
                                                         has_aux=True))(b["h"], b["w"])
    if cfg.mask_level is not None:   # the masks drop some tokens, not all
        assert 0 < float(m_u["masked_token_frac"]) < 1, m_u["masked_token_frac"]
    if cfg.weighs_staleness:
        assert 0 < float(m_u["staleness_weight_mean"]) < 1
    np.testing.assert_allclose(l_f, l_u, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(l_f, m_u["loss"], rtol=1e-5, atol=1e-7)
    ref_logp, ref_ent = token_logprobs_and_entropy(b["h"], b["w"], b["tgt"], chunk=CHUNK)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g_u[0]).max()) > 0 and float(jnp.abs(g_u[1]).max()) > 0
    for gf, gu in zip(g_f, g_u):
        np.testing.assert_allclose(gf, gu, rtol=1e-4, atol=1e-6)


def test_fused_loss_scales_with_the_cotangent_and_names_bad_shapes():
    cfg = losses.LossConfig()
    b = _batch(1)
    denoms = losses.loss_denominators(b["mask"], b["seg"])
    aux = losses.token_loss_aux(b["mask"], b["seg"], denoms, cfg, adv_BT=b["adv"],
                                old_logp_BT=b["old"])
    fn = functools.partial(losses.token_loss, cfg=cfg)
    loss = lambda h: fused_token_loss(h, b["w"], b["tgt"], fn, aux, chunk=CHUNK)[0]  # noqa: E731
    g1 = jax.grad(loss)(b["h"])
    g3 = jax.grad(lambda h: 3.0 * loss(h))(b["h"])
    np.testing.assert_allclose(g3, 3.0 * g1, rtol=1e-6)
    with pytest.raises(ValueError, match="aux\\['adv'\\] has shape"):
        fused_token_loss(b["h"], b["w"], b["tgt"], fn, {**aux, "adv": b["adv"][:, :5]})
    with pytest.raises(ValueError, match="ratio_level='token'"):
        losses.token_loss_aux(b["mask"], b["seg"], denoms,
                              losses.LossConfig(ratio_level="sequence"), adv_BT=b["adv"])


def test_a_sequence_level_correction_needs_old_log_probs_in_the_fused_pass():
    b = _batch(2)
    cfg = losses.LossConfig(tis_cap=2.0, tis_level="geometric")
    denoms = losses.loss_denominators(b["mask"], b["seg"])
    with pytest.raises(ValueError, match="needs old_logp_BT"):
        losses.token_loss_aux(b["mask"], b["seg"], denoms, cfg, adv_BT=b["adv"],
                              rollout_logp_BT=b["rollout"])
