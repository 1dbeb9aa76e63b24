"""The estimator and policy-loss registries: built-ins through them, plugins by path, clear
errors naming the config key, and a plugin loss in the update's loss (packed and fused)."""
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl import rl
from lrl.rl import losses, registry


def _module(name, **fns):
    """A throwaway importable module holding `fns`."""
    mod = types.ModuleType(name)
    for k, fn in fns.items():
        if callable(fn):
            fn.__module__ = name
        setattr(mod, k, fn)
    sys.modules[name] = mod
    return mod


def test_builtins_are_registered_with_what_they_ask_for():
    names = registry.estimator_names()
    for n in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_token", "remax", "gae"):
        assert n in names
    assert registry.estimator("reinforce_pp_token").wants == {"lengths_PG", "mask_P"}
    assert registry.estimator("remax").needs_baseline
    assert not registry.estimator("grpo").needs_baseline
    gae = registry.estimator("gae")
    assert gae.kind == "token" and gae.needs_critic and gae.fn is rl.gae
    assert registry.policy_loss_names()[0] == "ppo_clip"


def test_remax_subtracts_the_greedy_baseline():
    r = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5]])
    b = np.array([0.0, 1.0, 0.5])
    a = rl.advantages(r, "remax", baseline_P=b, mask_P=[True, True, False])
    # row 1 is uniform but its baseline differs: it still learns; row 2 is padding
    np.testing.assert_allclose(a, [[1.0, 0.0, 1.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    a1 = rl.advantages(np.array([[0.3], [1.0]]), "remax", baseline_P=[1.0, 0.0])   # G = 1
    np.testing.assert_allclose(a1, [[-0.7], [1.0]], rtol=1e-6)
    with pytest.raises(ValueError, match="remax needs baseline_P"):
        rl.advantages(r, "remax")


def test_gae_is_not_an_outcome_estimator():
    with pytest.raises(ValueError, match="'gae' is token-level.*critic"):
        rl.advantages(np.ones((2, 2)), "gae")


def test_plugin_estimator_by_path_gets_only_what_it_names():
    seen = {}

    def max_baseline(rewards_PG, *, mask_P=None):
        seen["mask_P"] = mask_P
        return rewards_PG - rewards_PG.max(axis=1, keepdims=True)

    _module("lrl_test_plugin_est", max_baseline=max_baseline)
    r = np.array([[1.0, 0.0, 0.5], [2.0, 2.0, 1.0]], np.float32)
    a = rl.advantages(r, "lrl_test_plugin_est:max_baseline", lengths_PG=np.ones((2, 3)),
                      mask_P=[True, False])
    np.testing.assert_allclose(a, [[0.0, -1.0, -0.5], [0.0, 0.0, 0.0]])   # padding row: 0
    np.testing.assert_array_equal(seen["mask_P"], [True, False])
    registry.check("lrl_test_plugin_est:max_baseline")


def test_bad_estimators_name_the_config_key():
    with pytest.raises(ValueError, match=r"rl.estimator='nope'.*unknown.*grpo"):
        registry.check("nope")
    with pytest.raises(ValueError, match=r"rl.estimator='no_such_mod_xyz:f'.*cannot import"):
        registry.check("no_such_mod_xyz:f")
    _module("lrl_test_plugin_bad", needs_more=lambda rewards_PG, temperature: rewards_PG,
            takes_nothing=lambda: None, value=3)
    with pytest.raises(ValueError, match=r"rl.estimator=.*requires \['temperature'\]"):
        registry.check("lrl_test_plugin_bad:needs_more")
    with pytest.raises(ValueError, match=r"rl.estimator=.*rewards_PG as its first argument"):
        registry.check("lrl_test_plugin_bad:takes_nothing")
    with pytest.raises(ValueError, match=r"rl.estimator=.*has no 'missing'"):
        registry.check("lrl_test_plugin_bad:missing")
    with pytest.raises(ValueError, match=r"rl.estimator=.*not callable"):
        registry.check("lrl_test_plugin_bad:value")
    with pytest.raises(ValueError, match=r"rl.loss.policy_loss='lrl_test_plugin_bad:needs_more'"):
        registry.check("grpo", "lrl_test_plugin_bad:needs_more")
    with pytest.raises(ValueError, match=r"rl.loss.policy_loss='ppo'.*ppo_clip"):
        registry.check("grpo", "ppo")
    with pytest.raises(ValueError, match=r"rl.estimator='gae'.*needs a critic"):
        registry.check("gae")
    assert registry.check("gae", critic=True).kind == "token"


def test_options_check_the_registry():
    from configs import default
    from lrl import options
    c = default.get_config("runlocal")
    c.rl.estimator = "no_such_thing"
    with pytest.raises(ValueError, match="rl.estimator='no_such_thing'"):
        options.from_config(c, check_files=False)
    c.rl.estimator = "remax"
    assert options.from_config(c, check_files=False).rl.estimator == "remax"


def test_reregistering_another_function_under_a_name_fails():
    with pytest.raises(ValueError, match="already registered"):
        registry.register_estimator("grpo")(lambda rewards_PG: rewards_PG)


def _vanilla_pg(logp_BT, old_logp_BT, adv_BT, mask_BT, cfg):
    """verl's "gpg"-like plain policy gradient with a ratio metric: -A * ratio, unclipped."""
    ratio = jnp.exp(logp_BT - old_logp_BT)
    return -adv_BT * ratio, {"ratio_sq": ratio ** 2}


registry.register_policy_loss("test_vanilla_pg")(_vanilla_pg)


def _batch(seed=0, B=3, T=6):
    rng = np.random.default_rng(seed)
    logp = jnp.asarray(rng.normal(-1.0, 0.3, (B, T)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.2, (B, T)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=B), jnp.float32)
    mask = jnp.asarray(rng.random((B, T)) < 0.8, jnp.float32)
    return logp, old, adv, mask


def test_default_policy_loss_is_the_registered_ppo_clip():
    logp, old, adv, mask = _batch()
    a = losses.policy_loss(logp, old, adv, mask, clip_high=0.28)
    b = losses.policy_loss(logp, old, adv, mask, clip_high=0.28, policy_loss="ppo_clip")
    np.testing.assert_array_equal(a[0], b[0])
    # the registered function is the same term the loss uses
    cfg = losses.LossConfig(clip_high=0.28)
    pg, _ = losses.ppo_clip(logp, old, jnp.broadcast_to(adv[:, None], logp.shape), mask > 0, cfg)
    w = mask / mask.sum()
    np.testing.assert_allclose(jnp.sum(w * pg), a[0], rtol=1e-6)


def test_plugin_policy_loss_replaces_the_term_and_keeps_lrl_terms():
    logp, old, adv, mask = _batch(1)
    m = np.asarray(mask)
    ratio = np.exp(np.asarray(logp) - np.asarray(old))
    term = -np.asarray(adv)[:, None] * ratio
    want = (m * term).sum() / m.sum()
    for spec in ("test_vanilla_pg", f"{__name__}:_vanilla_pg"):
        loss, met = losses.policy_loss(logp, old, adv, mask, aggregation="token_mean",
                                       policy_loss=spec)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        np.testing.assert_allclose(met["policy_loss/ratio_sq"], (m * ratio ** 2).sum() / m.sum(),
                                   rtol=1e-5)
    # KL and entropy stay lrl's
    ref = old - 0.1
    ent = jnp.ones_like(logp)
    loss, met = losses.policy_loss(logp, old, adv, mask, aggregation="token_mean",
                                   policy_loss="test_vanilla_pg", ref_logp_BT=ref, kl_coef=0.5,
                                   kl_estimator="k1", entropy_BT=ent, entropy_coef=0.1)
    kl = (m * (np.asarray(logp) - np.asarray(ref))).sum() / m.sum()
    np.testing.assert_allclose(loss, want + 0.5 * kl - 0.1, rtol=1e-5)
    # its gradient in logp is the plugin's: d(-A ratio)/dlogp = -A ratio
    g = jax.grad(lambda x: losses.policy_loss(x, old, adv, mask, aggregation="token_mean",
                                              policy_loss="test_vanilla_pg")[0])(logp)
    np.testing.assert_allclose(g, m * term / m.sum(), rtol=1e-5, atol=1e-7)


def test_plugin_policy_loss_fused_token_loss_matches_packed():
    # token_loss (the fused head's elementwise term) runs the plugin too: summed it is the loss
    logp, old, adv, mask = _batch(2)
    seg = jnp.ones(logp.shape, jnp.int32)
    cfg = losses.LossConfig(aggregation="seq_mean_token_mean", policy_loss="test_vanilla_pg")
    denoms = losses.loss_denominators(mask, seg)
    adv_BT = jnp.broadcast_to(adv[:, None], logp.shape)
    want, _ = losses.packed_policy_loss(logp, old, adv_BT, mask, seg, denoms, cfg)
    aux = losses.token_loss_aux(mask, seg, denoms, cfg, adv_BT=adv_BT, old_logp_BT=old)
    got = jnp.sum(losses.token_loss(logp, jnp.zeros_like(logp), aux, cfg=cfg))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_unknown_policy_loss_in_loss_config():
    with pytest.raises(ValueError, match="loss: policy_loss='nope'"):
        losses.LossConfig(policy_loss="nope")
