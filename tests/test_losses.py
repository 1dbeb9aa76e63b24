"""Policy-gradient objectives against numbers worked out by hand, and the packed,
decomposed form against the plain one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.rl import (LossConfig, combine_metrics, loss_denominators, packed_policy_loss,
                    policy_loss)
from lrl.rl.correction import staleness_weight

L = np.log


def test_token_ratio_clip_higher_and_metrics():
    # Row 0 (A=+1) ratios 1.5, 1.1; row 1 (A=-1) ratios 0.5, 0.9; clip 0.2 / 0.28.
    # Per-token loss: max(-1.5, -1.28) = -1.28, -1.1, max(0.5, 0.8) = 0.8, 0.9.
    logp = L(np.array([[1.5, 1.1], [0.5, 0.9]]))
    loss, m = policy_loss(logp, np.zeros((2, 2)), np.array([1.0, -1.0]), np.ones((2, 2)),
                          clip_low=0.2, clip_high=0.28)
    np.testing.assert_allclose(loss, (-1.28 - 1.1 + 0.8 + 0.9) / 4, rtol=1e-6)
    np.testing.assert_allclose(m["pg_loss"], loss)
    assert float(m["clip_frac_high"]) == 0.25 and float(m["clip_frac_low"]) == 0.25
    np.testing.assert_allclose([m["ratio_mean"], m["ratio_min"], m["ratio_max"]],
                               [1.0, 0.5, 1.5], rtol=1e-6)
    assert float(m["tokens"]) == 4.0
    # The gradient flows only through the unclipped tokens: d(-A·r)/dlogp = -A·r, over 4.
    g = jax.grad(lambda lp: policy_loss(lp, np.zeros((2, 2)), np.array([1.0, -1.0]),
                                        np.ones((2, 2)), clip_low=0.2, clip_high=0.28)[0])(
        jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(g, [[0.0, -1.1 / 4], [0.0, 0.9 / 4]], rtol=1e-5)


def test_dual_clip_caps_negative_advantages():
    # Tokens: (A=-1, r=5), (A=+1, r=5), (A=-2, r=4), (A=-1, r=2).
    # Plain clip: 5, -1.2, 8, 2.  Dual clip c=3 caps A<0 at -c·A: 3, -1.2, 6, 2.
    logp = L(np.array([[5.0], [5.0], [4.0], [2.0]]))
    adv = np.array([-1.0, 1.0, -2.0, -1.0])
    plain, _ = policy_loss(logp, np.zeros((4, 1)), adv, np.ones((4, 1)))
    np.testing.assert_allclose(plain, (5 - 1.2 + 8 + 2) / 4, rtol=1e-6)
    dual, m = policy_loss(logp, np.zeros((4, 1)), adv, np.ones((4, 1)), dual_clip=3.0)
    np.testing.assert_allclose(dual, (3 - 1.2 + 6 + 2) / 4, rtol=1e-6)
    assert float(m["dual_clip_frac"]) == 0.5


def _agg_case():
    # Row 0 (A=2): ratios 1.1, 1.2, 0.9 and a masked 7.0 -> -2.2, -2.4, -1.8 (sum -6.4).
    # Row 1 (A=-1): ratio 1.0 then three masked tokens -> +1.
    logp = L(np.array([[1.1, 1.2, 0.9, 7.0], [1.0, 3.0, 3.0, 3.0]]))
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    return logp, np.zeros((2, 4)), np.array([2.0, -1.0]), mask


@pytest.mark.parametrize("aggregation,max_len,expected", [
    ("token_mean", None, (-6.4 + 1.0) / 4),
    ("seq_mean_token_mean", None, (-6.4 / 3 + 1.0) / 2),
    ("seq_mean_token_sum_norm", None, (-6.4 + 1.0) / (2 * 4)),
    ("seq_mean_token_sum_norm", 10, (-6.4 + 1.0) / (2 * 10)),
])
def test_aggregations(aggregation, max_len, expected):
    loss, m = policy_loss(*_agg_case(), aggregation=aggregation, max_len=max_len)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(m["ratio_max"]) == pytest.approx(1.2) and float(m["tokens"]) == 4.0


def test_gspo_sequence_ratio_value_and_gradient():
    # Row 0: log-ratios 0.3, -0.1 and a masked 5 -> s = exp(0.1) = 1.10517, A=+1, unclipped.
    # Row 1: log-ratios 0.4, 0.2, 0 masked -> s = exp(0.3) = 1.34986 > 1.2, A=+1, clipped.
    lr = np.array([[0.3, -0.1, 5.0], [0.4, 0.2, 0.0]])
    mask = np.array([[1, 1, 0], [1, 1, 0]])
    adv = np.array([1.0, 1.0])
    f = lambda lp: policy_loss(lp, np.zeros((2, 3)), adv, mask, ratio_level="sequence",  # noqa
                               aggregation="seq_mean_token_mean")
    loss, m = f(jnp.asarray(lr, jnp.float32))
    s0 = np.exp(0.1)
    np.testing.assert_allclose(loss, (-s0 - 1.2) / 2, rtol=1e-6)
    np.testing.assert_allclose([m["ratio_min"], m["ratio_max"]], [s0, np.exp(0.3)], rtol=1e-6)
    assert float(m["clip_frac_high"]) == 0.5
    # d/dlogp_t of -A·s with s = exp(mean of 2 log-ratios) is -s/2, then / 2 sequences;
    # the clipped row and the masked token get nothing.
    g = jax.grad(lambda lp: f(lp)[0])(jnp.asarray(lr, jnp.float32))
    np.testing.assert_allclose(g, [[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]], rtol=1e-5)
    # Token level on the same data differs (per-token ratios e^0.3 = 1.35 > 1.2 clipped, ...).
    tok, _ = policy_loss(lr, np.zeros((2, 3)), adv, mask, aggregation="seq_mean_token_mean")
    assert abs(float(tok) - float(loss)) > 1e-3


@pytest.mark.parametrize("estimator,expected", [("k1", 0.0), ("k2", 0.2402265), ("k3", 0.25)])
def test_kl_estimators(estimator, expected):
    # Token 0: logp = log .5, ref = log .25 -> k1 = .693147, k2 = .240227, k3 = .193147.
    # Token 1: logp = log .5, ref = log 1   -> k1 = -.693147, k2 = .240227, k3 = .306853.
    logp = L(np.array([[0.5, 0.5]]))
    ref = L(np.array([[0.25, 1.0]]))
    loss, m = policy_loss(logp, logp, np.array([0.0]), np.ones((1, 2)), ref_logp_BT=ref,
                          kl_coef=0.1, kl_estimator=estimator)
    np.testing.assert_allclose(m["kl"], expected, atol=1e-6)
    np.testing.assert_allclose(loss, 0.1 * expected, atol=1e-7)


@pytest.mark.parametrize("d", [2.0, 2.6, 3.0, 5.0, 20.0, 40.0, -30.0])
def test_kl_estimators_at_large_log_ratios(d):
    """d = ref - logp per token. k3 = e^d - d - 1 is capped at 10, as verl's low_var_kl
    (e^d - d - 1 = 10 at d = 2.611 and d = -11.0); k1 and k2 take d clipped to [-20, 20]."""
    logp = np.zeros((1, 1), np.float32)
    ref = np.full((1, 1), d, np.float32)
    kl = {est: float(policy_loss(logp, logp, np.array([0.0]), np.ones((1, 1)), ref_logp_BT=ref,
                                 kl_coef=0.1, kl_estimator=est)[1]["kl"])
          for est in ("k1", "k2", "k3")}
    dc = float(np.clip(d, -20.0, 20.0))
    np.testing.assert_allclose(kl["k3"], min(np.expm1(dc) - dc, 10.0), rtol=1e-6)
    np.testing.assert_allclose(kl["k1"], -dc, rtol=1e-6)
    np.testing.assert_allclose(kl["k2"], 0.5 * dc * dc, rtol=1e-6)
    # Past the cap the k3 term carries no gradient (as torch.clamp's); below it, e^d - 1.
    g = jax.grad(lambda lp: policy_loss(lp, lp, np.array([0.0]), np.ones((1, 1)),
                                        ref_logp_BT=ref, kl_coef=1.0)[0])(jnp.asarray(logp))
    want = 0.0 if np.expm1(dc) - dc > 10.0 else -np.expm1(dc)
    np.testing.assert_allclose(float(g[0, 0]), want, rtol=1e-5, atol=1e-7)


def test_entropy_bonus():
    loss, m = policy_loss(np.zeros((1, 3)), np.zeros((1, 3)), np.array([0.5]),
                          np.array([[1, 1, 0]]), entropy_BT=np.array([[1.0, 2.0, 9.0]]),
                          entropy_coef=0.01)
    np.testing.assert_allclose(m["entropy"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(loss, -0.5 - 0.01 * 1.5, rtol=1e-6)


def test_truncated_importance_sampling():
    # old - rollout = log 3, log 0.5 -> weights min(3, 2) = 2 and 0.5; ratio 1, A = 1.
    old = np.zeros((1, 2))
    rollout = -L(np.array([[3.0, 0.5]]))
    f = lambda lp: policy_loss(lp, old, np.array([1.0]), np.ones((1, 2)),  # noqa: E731
                               rollout_logp_BT=rollout, tis_cap=2.0)
    loss, m = f(jnp.zeros((1, 2)))
    np.testing.assert_allclose(loss, (-2.0 - 0.5) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["tis_weight_mean"], 1.25, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda lp: f(lp)[0])(jnp.zeros((1, 2))),
                               [[-1.0, -0.25]], rtol=1e-6)


@pytest.mark.parametrize("level,expected_w", [
    ("token", [[1.5, 1.2], [2.0, 2.0]]),                 # min(e^Δ_t, 2)
    ("sequence", [[1.8, 1.8], [2.0, 2.0]]),              # min(1.5·1.2, 2), min(3·2, 2)
    ("geometric", [[1.8 ** 0.5] * 2, [2.0, 2.0]]),       # min(√1.8, 2), min(√6 = 2.449, 2)
])
def test_truncated_importance_sampling_at_every_level(level, expected_w):
    # old - rollout = log of the token ratios 1.5, 1.2 (row 0) and 3, 2 (row 1); the policy
    # ratio is 1 and A = 1, so each token's term is -w and its gradient -w / 4.
    old = np.zeros((2, 2))
    rollout = -L(np.array([[1.5, 1.2], [3.0, 2.0]]))
    f = lambda lp: policy_loss(lp, old, np.ones(2), np.ones((2, 2)),  # noqa: E731
                               rollout_logp_BT=rollout, tis_cap=2.0, tis_level=level)
    w = np.array(expected_w)
    loss, m = f(jnp.zeros((2, 2)))
    np.testing.assert_allclose(loss, -w.sum() / 4, rtol=1e-6)
    np.testing.assert_allclose(m["tis_weight_mean"], w.mean(), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda lp: f(lp)[0])(jnp.zeros((2, 2))), -w / 4,
                               rtol=1e-6)
    assert float(m["masked_token_frac"]) == 0.0 and float(m["staleness_weight_mean"]) == 1.0


@pytest.mark.parametrize("level,low,high,keep,seq_frac", [
    # token ratios 1.5, 0.4 (row 0) and 3, 1.1 (row 1); sequence products 0.6 and 3.3;
    # geometric means √0.6 = 0.775 and √3.3 = 1.817.
    ("token", 0.5, 2.0, [[1, 0], [0, 1]], 1.0),          # 0.4 and 3 leave [0.5, 2]
    ("sequence", 0.5, 2.0, [[1, 1], [0, 0]], 0.5),       # 3.3 leaves it: all of row 1
    ("geometric", 0.5, 2.0, [[1, 1], [1, 1]], 0.0),      # both means inside
    ("geometric", 0.8, 2.0, [[0, 0], [1, 1]], 0.5),      # 0.775 < 0.8: all of row 0
])
def test_masked_importance_sampling(level, low, high, keep, seq_frac):
    # A = 1, -0.5 and ratio 1: token terms -1, -1, 0.5, 0.5; a masked token leaves the loss
    # (its entropy too) but not the denominator of 4 tokens.
    old = np.zeros((2, 2))
    rollout = -L(np.array([[1.5, 0.4], [3.0, 1.1]]))
    ent = np.array([[1.0, 2.0], [3.0, 4.0]])
    loss, m = policy_loss(np.zeros((2, 2)), old, np.array([1.0, -0.5]), np.ones((2, 2)),
                          rollout_logp_BT=rollout, mask_level=level, mask_low=low,
                          mask_high=high, entropy_BT=ent, entropy_coef=0.1)
    keep = np.array(keep, np.float64)
    pg = np.array([[-1.0, -1.0], [0.5, 0.5]])
    np.testing.assert_allclose(m["pg_loss"], (keep * pg).sum() / 4, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m["entropy"], (keep * ent).sum() / 4, rtol=1e-6)
    np.testing.assert_allclose(loss, (keep * (pg - 0.1 * ent)).sum() / 4, rtol=1e-6)
    np.testing.assert_allclose(m["masked_token_frac"], 1 - keep.mean(), rtol=1e-6)
    np.testing.assert_allclose(m["masked_seq_frac"], seq_frac, rtol=1e-6)
    assert float(m["tis_weight_mean"]) == 1.0     # no tis_cap: IS weights are 1


def test_staleness_weight():
    np.testing.assert_allclose(staleness_weight(np.array([0, 1, 2, 3]), decay=0.5, max_age=2),
                               [1.0, 0.5, 0.25, 0.0])
    np.testing.assert_allclose(staleness_weight(np.array([0, 5])), [1.0, 1.0])
    # Rows of ages 0 and 2, A = 1 and ratio 1: token terms -1 weighted 1, 1, 0.25, 0.25.
    kw = dict(age_B=np.array([0, 2]), staleness_decay=0.5)
    loss, m = policy_loss(np.zeros((2, 2)), np.zeros((2, 2)), np.ones(2), np.ones((2, 2)), **kw)
    np.testing.assert_allclose(loss, -(2 * 1.0 + 2 * 0.25) / 4, rtol=1e-6)
    np.testing.assert_allclose(m["staleness_weight_mean"], 0.625, rtol=1e-6)
    loss, m = policy_loss(np.zeros((2, 2)), np.zeros((2, 2)), np.ones(2), np.ones((2, 2)),
                          max_staleness=1, **kw)                 # age 2 > 1: weight 0
    np.testing.assert_allclose(loss, -2.0 / 4, rtol=1e-6)
    np.testing.assert_allclose(m["staleness_weight_mean"], 0.5, rtol=1e-6)


def test_no_tokens_gives_zero_not_nan():
    loss, m = policy_loss(np.zeros((2, 3)), np.zeros((2, 3)), np.ones(2), np.zeros((2, 3)),
                          aggregation="seq_mean_token_mean")
    assert float(loss) == 0.0 and float(m["ratio_mean"]) == 0.0


def _packed_case(seed=0):
    """Five sequences: packed into 2 rows of 8, and the same laid out one per row."""
    rng = np.random.default_rng(seed)
    lens = [3, 4, 2, 5, 3]
    rows = [[0, 1], [2, 3], [4]]  # rows of 8: 3+4 and 2+5 tokens plus one pad; 3 plus 5 pads
    t = 8
    logp_S = [rng.normal(-1.0, 0.3, n) for n in lens]
    old_S = [lp + rng.normal(0.0, 0.2, len(lp)) for lp in logp_S]
    ref_S = [lp + rng.normal(0.0, 0.3, len(lp)) for lp in logp_S]
    ent_S = [rng.uniform(0.5, 2.0, n) for n in lens]
    roll_S = [o + rng.normal(0.0, 0.3, len(o)) for o in old_S]  # the sampler's
    mask_S = [np.r_[0, np.ones(n - 1)] for n in lens]          # first token is the prompt
    adv_S = rng.normal(size=len(lens))
    age_S = np.array([0, 1, 2, 0, 1])
    packed = {k: np.zeros((len(rows), t)) for k in ("lp", "old", "ref", "ent", "mask", "adv",
                                                    "roll", "age")}
    packed["seg"] = np.zeros((len(rows), t), np.int32)
    for r, ids in enumerate(rows):
        pos = 0
        for j, s in enumerate(ids):
            sl = slice(pos, pos + lens[s])
            for k, src in (("lp", logp_S), ("old", old_S), ("ref", ref_S), ("ent", ent_S),
                           ("mask", mask_S), ("roll", roll_S)):
                packed[k][r, sl] = src[s]
            packed["adv"][r, sl] = adv_S[s]
            packed["age"][r, sl] = age_S[s]
            packed["seg"][r, sl] = j + 1
            pos += lens[s]
    plain = {k: np.zeros((len(lens), t)) for k in ("lp", "old", "ref", "ent", "mask", "roll")}
    for s, n in enumerate(lens):
        for k, src in (("lp", logp_S), ("old", old_S), ("ref", ref_S), ("ent", ent_S),
                       ("mask", mask_S), ("roll", roll_S)):
            plain[k][s, :n] = src[s]
    plain["adv"], plain["age"] = adv_S, age_S
    return packed, plain


OPTS = [dict(aggregation=a, ratio_level=r) for a in ("token_mean", "seq_mean_token_mean",
                                                     "seq_mean_token_sum_norm")
        for r in ("token", "sequence")]
# Rollout corrections at every level (the sampler's log-probs lie within ±0.3 of old's).
CORRECTIONS = {
    "none": {},
    "seq_tis_token_mask": dict(tis_cap=1.5, tis_level="sequence", mask_level="token",
                               mask_low=0.8, mask_high=1.25),
    "geo_tis_seq_mask_stale": dict(tis_cap=1.1, tis_level="geometric", mask_level="sequence",
                                   mask_low=0.5, mask_high=1.5, staleness_decay=0.5,
                                   max_staleness=1),
    "geo_mask": dict(mask_level="geometric", mask_low=0.85, mask_high=1.3),
}


def _corr_inputs(arrays, corr, per_row_age=False):
    """The rollout log-probs (and ages) a correction reads, as keyword arguments."""
    kw = {}
    if "tis_cap" in corr or "mask_level" in corr:
        kw["rollout_logp_BT"] = arrays["roll"]
    if "staleness_decay" in corr:
        kw["age_B" if per_row_age else "age_BT"] = arrays["age"]
    return kw


@pytest.mark.parametrize("corr", sorted(CORRECTIONS))
@pytest.mark.parametrize("opts", OPTS, ids=lambda o: f"{o['aggregation']}-{o['ratio_level']}")
def test_packed_equals_one_sequence_per_row(opts, corr):
    packed, plain = _packed_case()
    kw = dict(clip_low=0.1, clip_high=0.15, kl_coef=0.05, entropy_coef=0.01, max_len=6, **opts,
              **CORRECTIONS[corr])
    ref, ref_m = policy_loss(plain["lp"], plain["old"], plain["adv"], plain["mask"],
                             ref_logp_BT=plain["ref"], entropy_BT=plain["ent"], **kw,
                             **_corr_inputs(plain, CORRECTIONS[corr], per_row_age=True))
    cfg = LossConfig(**{k: v for k, v in kw.items()})
    den = loss_denominators(packed["mask"], packed["seg"], cfg.max_len)
    arr = {k: jnp.asarray(v) for k, v in packed.items()}
    got, m = packed_policy_loss(*(arr[k] for k in ("lp", "old", "adv", "mask")), arr["seg"],
                                den, cfg, ref_logp_BT=arr["ref"], entropy_BT=arr["ent"],
                                **_corr_inputs(arr, CORRECTIONS[corr]))
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    for k in ref_m:
        np.testing.assert_allclose(m[k], ref_m[k], rtol=1e-5, err_msg=k)
    if cfg.mask_level is not None:   # the case masks some sequences' tokens, not all
        assert 0 < float(m["masked_token_frac"]) < 1 and 0 < float(m["masked_seq_frac"]) < 1
    if cfg.tis_cap is not None:
        assert float(m["tis_weight_mean"]) != 1.0


@pytest.mark.parametrize("corr", sorted(CORRECTIONS))
@pytest.mark.parametrize("opts", OPTS, ids=lambda o: f"{o['aggregation']}-{o['ratio_level']}")
def test_micro_batches_sum_to_the_whole(opts, corr):
    packed, _ = _packed_case(1)
    cfg = LossConfig(clip_low=0.1, clip_high=0.15, kl_coef=0.05, entropy_coef=0.01,
                     max_len=6, dual_clip=2.0, **opts, **CORRECTIONS[corr])
    arr = {k: jnp.asarray(v) for k, v in packed.items()}
    den = loss_denominators(arr["mask"], arr["seg"], cfg.max_len)

    def f(lp, rows):
        extra = {k: v[rows] for k, v in _corr_inputs(arr, CORRECTIONS[corr]).items()}
        return packed_policy_loss(lp, arr["old"][rows], arr["adv"][rows], arr["mask"][rows],
                                  arr["seg"][rows], den, cfg, ref_logp_BT=arr["ref"][rows],
                                  entropy_BT=arr["ent"][rows], **extra)

    (whole, wm), g_whole = jax.value_and_grad(f, has_aux=True)(arr["lp"], slice(None))
    parts = [jax.value_and_grad(f, has_aux=True)(arr["lp"][r:r + 1], slice(r, r + 1))
             for r in range(3)]
    np.testing.assert_allclose(sum(p[0][0] for p in parts), whole, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), g_whole, rtol=1e-6)
    m = parts[0][0][1]
    for p in parts[1:]:
        m = combine_metrics(m, p[0][1])
    for k in wm:
        np.testing.assert_allclose(m[k], wm[k], rtol=1e-6, err_msg=k)


def test_bad_options_name_the_culprit():
    z = np.zeros((1, 2))
    with pytest.raises(ValueError, match="aggregation 'mean'"):
        policy_loss(z, z, np.zeros(1), z, aggregation="mean")
    with pytest.raises(ValueError, match="ratio_level 'seq'"):
        policy_loss(z, z, np.zeros(1), z, ratio_level="seq")
    with pytest.raises(ValueError, match="kl_estimator 'k4'"):
        policy_loss(z, z, np.zeros(1), z, kl_estimator="k4", ref_logp_BT=z)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(z, z, np.zeros(1), z, dual_clip=0.5)
    with pytest.raises(ValueError, match=r"adv_B must be \[B\]"):
        policy_loss(z, z, np.zeros(2), z)
    with pytest.raises(ValueError, match="old_logp_BT has shape"):
        policy_loss(z, np.zeros((1, 3)), np.zeros(1), z)
    with pytest.raises(ValueError, match="needs ref_logp_BT"):
        policy_loss(z, z, np.zeros(1), z, kl_coef=0.1)
    with pytest.raises(ValueError, match="rollout_logp_BT"):
        policy_loss(z, z, np.zeros(1), z, tis_cap=2.0)
    with pytest.raises(ValueError, match="rollout_logp_BT"):
        policy_loss(z, z, np.zeros(1), z, mask_level="geometric")
    with pytest.raises(ValueError, match="age_BT"):
        policy_loss(z, z, np.zeros(1), z, staleness_decay=0.5)
    with pytest.raises(ValueError, match="tis_level 'seq'"):
        policy_loss(z, z, np.zeros(1), z, tis_level="seq")
    with pytest.raises(ValueError, match="mask_level 'product'"):
        policy_loss(z, z, np.zeros(1), z, mask_level="product")
    with pytest.raises(ValueError, match="mask_low <= 1 <= mask_high"):
        policy_loss(z, z, np.zeros(1), z, mask_level="token", mask_low=1.2)
    with pytest.raises(ValueError, match="staleness_decay"):
        policy_loss(z, z, np.zeros(1), z, staleness_decay=1.5)
