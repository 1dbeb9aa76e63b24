"""GAE, the clipped value loss and KL in the reward, against numbers worked out by hand and a
line-by-line numpy transcription of verl's loops; packed against padded, micro-batch shares
against the whole."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest


import lrl.rl.kl as kl_lib
from lrl import rl
from lrl.rl import losses, values


def verl_gae(r, v, m, gamma, lam):
    """verl's compute_gae_advantage_return, transcribed to numpy (float64)."""
    nextvalues = np.zeros(r.shape[0])
    lastgaelam = np.zeros(r.shape[0])
    out = []
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = np.stack(out[::-1], axis=1)
    returns = adv + v
    mean = (adv * m).sum() / m.sum()
    var = (((adv - mean) ** 2) * m).sum() / m.sum() * m.sum() / (m.sum() - 1)
    return (adv - mean) / np.sqrt(var + 1e-8), returns


def test_gae_by_hand_with_an_observation_token():
    # Worked backwards: t=4 (off): carries stay 0. t=3: delta = 1 - 4 = -3, L = -3, next v 4.
    # t=2 (off): L stays -3. t=1: delta = .9*4 - 2 = 1.6, L = 1.6 + .45*(-3) = .25, next v 2.
    # t=0: delta = .9*2 - 1 = .8, L = .8 + .45*.25 = .9125.
    r = np.array([[0.0, 0.0, 0.0, 1.0, 0.0]])
    v = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
    m = np.array([[1.0, 1.0, 0.0, 1.0, 0.0]])
    adv, ret = rl.gae(r, v, m, 0.9, 0.5)
    np.testing.assert_allclose(ret, [[1.9125, 2.25, 0.0, 1.0, 5.0]], rtol=1e-6)
    raw = np.array([0.9125, 0.25, -3.0])     # the masked ones
    mean, std = raw.mean(), raw.std(ddof=1)
    np.testing.assert_allclose(np.asarray(adv)[0, [0, 1, 3]], (raw - mean) / std, rtol=1e-5)
    raw_p, ret_p = rl.gae_packed(r, v, m, np.ones_like(m, np.int32), 0.9, 0.5)
    np.testing.assert_allclose(raw_p, [[0.9125, 0.25, 0.0, -3.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(ret_p, [[1.9125, 2.25, 0.0, 1.0, 0.0]], rtol=1e-6)


def test_gae_gamma_lam_one_is_return_minus_value():
    # gamma = lam = 1: the raw advantage is (sum of later rewards) - v_t: [.5, .8, .9].
    adv, ret = rl.gae([[0.0, 0.0, 1.0]], [[0.5, 0.2, 0.1]], [[1, 1, 1]], 1.0, 1.0)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0]], rtol=1e-6)
    raw = np.array([0.5, 0.8, 0.9])
    np.testing.assert_allclose(adv, [(raw - raw.mean()) / raw.std(ddof=1)], rtol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0)])
def test_gae_matches_verl_everywhere(gamma, lam):
    rng = np.random.default_rng(0)
    B, T = 4, 37
    r, v = rng.normal(size=(B, T)), rng.normal(size=(B, T))
    m = (rng.random((B, T)) < 0.7).astype(np.float64)
    m[:, -5:] = 0.0                     # right padding
    want_adv, want_ret = verl_gae(r, v, m, gamma, lam)
    adv, ret = jax.jit(rl.gae, static_argnums=(3, 4))(r, v, m, gamma, lam)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-4, atol=1e-4)


def _pack(seqs, T):
    """Rows of several (r, v, m) sequences back to back, the rest padding (segment 0)."""
    out = {k: np.zeros((len(seqs), T)) for k in "rvm"}
    seg = np.zeros((len(seqs), T), np.int32)
    where = []
    for b, row in enumerate(seqs):
        t = 0
        for s, (r, v, m) in enumerate(row, start=1):
            n = len(r)
            out["r"][b, t:t + n], out["v"][b, t:t + n], out["m"][b, t:t + n] = r, v, m
            seg[b, t:t + n] = s
            where.append((b, t, n))
            t += n
    # padding holds garbage that must not leak in
    out["v"][seg == 0] = 7.0
    out["r"][seg == 0] = 3.0
    out["m"][seg == 0] = 1.0
    return out["r"], out["v"], out["m"], seg, where


def test_gae_packed_equals_padded_per_sequence():
    rng = np.random.default_rng(1)
    # each sequence: a prompt (mask 0), a response (mask 1) with an observation gap (mask 0)
    seqs = []
    for lengths in ((9, 14), (21,), (5, 6, 8)):
        row = []
        for n in lengths:
            m = np.ones(n)
            m[:3] = 0.0
            m[n // 2] = 0.0
            row.append((rng.normal(size=n), rng.normal(size=n), m))
        seqs.append(row)
    r, v, m, seg, where = _pack(seqs, 24)
    gamma, lam = 0.95, 0.9
    raw, ret = jax.jit(rl.gae_packed, static_argnums=(4, 5))(r, v, m, seg, gamma, lam)
    raw, ret = np.asarray(raw), np.asarray(ret)
    flat = [x for row in seqs for x in row]
    for (b, t, n), (rs, vs, ms) in zip(where, flat):
        # each alone on a padded row of its own (verl's layout), before whitening
        _, want_ret = verl_gae(rs[None], vs[None], ms[None], gamma, lam)
        want_raw = want_ret - vs[None]
        on = ms > 0
        np.testing.assert_allclose(raw[b, t:t + n][on], want_raw[0][on], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret[b, t:t + n][on], want_ret[0][on], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(raw[b, t:t + n][~on], 0.0)
    np.testing.assert_array_equal(raw[seg == 0], 0.0)
    # whitened over all sequences' response tokens = verl's whitening of the padded batch
    mask = np.where(seg > 0, m, 0.0)
    white = rl.whiten(raw, mask, rl.whiten_stats(raw, mask))
    T = max(n for _, _, n in where)
    pr, pv, pm = (np.zeros((len(flat), T)) for _ in range(3))
    for i, (rs, vs, ms) in enumerate(flat):
        pr[i, :len(rs)], pv[i, :len(rs)], pm[i, :len(rs)] = rs, vs, ms
    want_adv, _ = verl_gae(pr, pv, pm, gamma, lam)
    for i, (b, t, n) in enumerate(where):
        on = pm[i, :n] > 0
        np.testing.assert_allclose(np.asarray(white)[b, t:t + n][on], want_adv[i, :n][on],
                                   rtol=1e-4, atol=1e-5)


def test_whitening_over_micro_batches_equals_whole():
    rng = np.random.default_rng(2)
    x = rng.normal(1.0, 2.0, size=(6, 11)).astype(np.float32)
    m = (rng.random((6, 11)) < 0.6).astype(np.float32)
    parts = [(x[:4], m[:4]), (x[4:], m[4:])]
    stats = rl.combine_stats(*(rl.whiten_stats(a, b) for a, b in parts))
    split = np.concatenate([np.asarray(rl.whiten(a, b, stats)) for a, b in parts])
    whole = rl.whiten(x, m, rl.whiten_stats(x, m))
    np.testing.assert_allclose(split, whole, rtol=1e-6, atol=1e-6)
    sel = x[m > 0].astype(np.float64)
    want = (x - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(whole, np.where(m > 0, want, 0.0), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- value loss

def test_value_loss_by_hand():
    # c = 0.2. Token 0: v=1.0, old=0.5 -> clipped 0.7, R=0: sq1=1, sq2=.49 -> 1 (not clipped).
    # Token 1: v=0.0, old=0.5 -> clipped 0.3, R=1: sq1=1, sq2=.49 -> 1. Token 2: v=2, old=2.1,
    # R=3: clipped 2 (in band), sq1=sq2=1 -> 1. Token 3: v=1, old=0, R=0: clipped .2, sq1=1,
    # sq2=.04 -> 1. Row 1, token 0: v=0, old=1, R=2: clipped .8, sq1=4, sq2=1.44 -> 4;
    # token 1: v=3, old=1, R=0: clipped 1.2: sq1=9, sq2=1.44 -> 9... make one clip bind:
    # token 2: v=0, old=1, R=-1: clipped .8, sq1=1, sq2=3.24 -> 3.24 (clipped is larger).
    v = np.array([[1.0, 0.0, 2.0, 1.0], [0.0, 3.0, 0.0, 9.0]])
    old = np.array([[0.5, 0.5, 2.1, 0.0], [1.0, 1.0, 1.0, 9.0]])
    ret = np.array([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, -1.0, 9.0]])
    m = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)
    per_token = np.array([[1.0, 1.0, 1.0, 1.0], [4.0, 9.0, 3.24, 0.0]])
    loss, met = rl.value_loss(v, old, ret, m, 0.2, "token_mean")
    np.testing.assert_allclose(loss, 0.5 * per_token.sum() / 7, rtol=1e-6)
    np.testing.assert_allclose(met["vf_clipfrac"], 1 / 7, rtol=1e-6)
    np.testing.assert_allclose(met["vpred_mean"], 7.0 / 7, rtol=1e-6)
    loss, _ = rl.value_loss(v, old, ret, m, 0.2, "seq_mean_token_mean")
    np.testing.assert_allclose(loss, 0.5 * (4.0 / 4 + 16.24 / 3) / 2, rtol=1e-6)
    loss, _ = rl.value_loss(v, old, ret, m, 0.2, "seq_mean_token_sum_norm")
    np.testing.assert_allclose(loss, 0.5 * 20.24 / (2 * 4), rtol=1e-6)


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_value_loss_packed_equals_padded_and_micro_shares_add_up(aggregation):
    rng = np.random.default_rng(3)
    lengths = [5, 7, 3, 6, 4]
    seqs = [tuple(rng.normal(size=n) for _ in range(3)) + ((rng.random(n) < 0.8) * 1.0,)
            for n in lengths]
    T = max(lengths)
    pad = lambda i: np.stack([np.pad(s[i], (0, T - len(s[i]))) for s in seqs])  # noqa: E731
    v, old, ret, m = (pad(i) for i in range(4))
    want, want_m = rl.value_loss(v, old, ret, m, 0.3, aggregation, max_len=9)
    # packed: rows of 10, [5+3] [7] [6+4] -> two micro-batches of rows [0, 1] and [2]
    rows = [[0, 2], [1], [3, 4]]
    B, L = len(rows), 10
    arr = {k: np.zeros((B, L)) for k in ("v", "old", "ret", "m")}
    seg = np.zeros((B, L), np.int32)
    for b, row in enumerate(rows):
        t = 0
        for s, i in enumerate(row, start=1):
            n = lengths[i]
            for k, j in zip(("v", "old", "ret", "m"), range(4)):
                arr[k][b, t:t + n] = seqs[i][j]
            seg[b, t:t + n] = s
            t += n
    arr["v"][seg == 0], arr["m"][seg == 0] = 100.0, 1.0   # garbage in the padding
    denoms = losses.loss_denominators(arr["m"], seg, max_len=9)
    total, mets = 0.0, None
    for sl in (slice(0, 2), slice(2, 3)):
        part, pm = values.packed_value_loss(arr["v"][sl], arr["old"][sl], arr["ret"][sl],
                                            arr["m"][sl], seg[sl], denoms, 0.3, aggregation)
        total += float(part)
        mets = pm if mets is None else losses.combine_metrics(mets, pm)
    np.testing.assert_allclose(total, want, rtol=1e-5)
    for k in want_m:
        np.testing.assert_allclose(mets[k], want_m[k], rtol=1e-5, err_msg=k)
    # the gradient of the shares is the gradient of the whole
    g_whole = jax.grad(lambda x: rl.value_loss(x, old, ret, m, 0.3, aggregation, max_len=9)[0])(
        jnp.asarray(v, jnp.float32))
    g_packed = jax.grad(lambda x: values.packed_value_loss(x, arr["old"], arr["ret"], arr["m"],
                                                           seg, denoms, 0.3, aggregation)[0])(
        jnp.asarray(arr["v"], jnp.float32))
    for b, row in enumerate(rows):
        t = 0
        for i in row:
            n = lengths[i]
            np.testing.assert_allclose(g_packed[b, t:t + n], g_whole[i, :n], rtol=1e-5,
                                       atol=1e-7)
            t += n


# --------------------------------------------------------------------------- KL in reward

def test_kl_penalty_by_hand():
    old = np.array([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    ref = np.array([[-1.5, -1.0, -0.5, -9.0], [-2.0, -1.0, 0.0, 0.0]])
    m = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    r = np.array([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    out, met = kl_lib.kl_penalty(r, old, ref, m, 0.1, "k1")
    # k1 = old - ref: [.5, -1, 0, (off)], [1, 0]; per-sequence means -1/6 and 1/2.
    np.testing.assert_allclose(out, [[-0.05, 0.1, 1.0, 0.0], [-0.1, 2.0, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(met["kl"], (-0.5 / 3 + 0.5) / 2, rtol=1e-6)
    # low_var_kl = k3: d = ref - old; d = -.5 -> e^-.5 + .5 - 1 = .1065307; d = 1 -> e - 2 =
    # .7182818; d = -1 -> e^-1 = .3678794
    out, met = kl_lib.kl_penalty(r, old, ref, m, 1.0, "low_var_kl")
    np.testing.assert_allclose(out[0, :3], [-0.1065307, -0.7182818, 1.0], rtol=1e-6)
    np.testing.assert_allclose(out[1, :2], [-0.3678794, 2.0], rtol=1e-6)
    # k2 = ½ d²
    out, _ = kl_lib.kl_penalty(r, old, ref, m, 1.0, "k2")
    np.testing.assert_allclose(out[0, :3], [-0.125, -0.5, 1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="unknown estimator"):
        kl_lib.kl_penalty(r, old, ref, m, 1.0, "k9")


def test_kl_penalty_packed_metrics_match_padded():
    rng = np.random.default_rng(4)
    old, ref = rng.normal(size=(2, 6)), rng.normal(size=(2, 6))
    m = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], np.float32)
    r = np.zeros((2, 6))
    _, want = kl_lib.kl_penalty(r, old, ref, m, 0.5, "k3")
    # the two sequences packed into one row of 9: [seq0 (3), seq1 (5), pad]
    p = lambda x: np.concatenate([x[0, :3], x[1, :5], [0.0]])[None]  # noqa: E731
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0]])
    out, got = kl_lib.kl_penalty(p(r), p(old), p(ref), p(m), 0.5, "k3", segment_ids_BT=seg)
    for k in ("kl", "kl_seq_mean_sum", "kl_sequences"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
    sums = kl_lib.segment_sums(kl_lib.token_kl(p(old), p(ref), p(m), "k3"), seg)
    np.testing.assert_allclose(sums[0, 1:3], kl_lib.sequence_kl(old, ref, m, "k3"), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out)[0, :8].sum(), -0.5 * float(sums.sum()), rtol=1e-6)


def test_kl_in_score():
    s = kl_lib.kl_in_score([[1.0, 0.0]], [[0.5, 2.0]], 0.1)
    np.testing.assert_allclose(s, [[0.95, -0.2]], rtol=1e-6)


def test_kl_controllers():
    assert kl_lib.update_kl_coef(0.05, 3.0, 256, control="fixed") == 0.05
    # 0.12 / 0.1 - 1 = 0.2 (at the clip): 0.05 * (1 + 0.2 * 256 / 10000)
    c = kl_lib.update_kl_coef(0.05, 0.12, 256, control="adaptive", target_kl=0.1, horizon=1e4)
    np.testing.assert_allclose(c, 0.05 * (1 + 0.2 * 0.0256), rtol=1e-12)
    # far above the target: clipped at +0.2; far below: at -0.2; 0.09: -0.1
    hi = kl_lib.update_kl_coef(0.05, 5.0, 100, control="adaptive", target_kl=0.1, horizon=1e3)
    lo = kl_lib.update_kl_coef(0.05, 0.0, 100, control="adaptive", target_kl=0.1, horizon=1e3)
    mid = kl_lib.update_kl_coef(0.05, 0.09, 100, control="adaptive", target_kl=0.1, horizon=1e3)
    np.testing.assert_allclose([hi, lo, mid], [0.05 * 1.02, 0.05 * 0.98, 0.05 * 0.99],
                               rtol=1e-9)
    with pytest.raises(ValueError, match="unknown control"):
        kl_lib.update_kl_coef(0.05, 0.1, 1, control="pid")


def test_gae_packed_and_whitening_run_sharded_over_rows():
    # rows split over the 8 devices: the scan runs along T within each row, the whitening's
    # sums over every row; the same numbers as on one device
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    rng = np.random.default_rng(5)
    B, T = 8, 16
    r, v = rng.normal(size=(B, T)).astype(np.float32), rng.normal(size=(B, T)).astype(np.float32)
    m = (rng.random((B, T)) < 0.7).astype(np.float32)
    seg = np.repeat(np.array([[1] * 5 + [2] * 7 + [0] * 4]), B, axis=0).astype(np.int32)

    def step(r, v, m, seg):
        raw, ret = rl.gae_packed(r, v, m, seg, 0.99, 0.95)
        mask = jnp.where(seg > 0, m, 0.0)
        return rl.whiten(raw, mask, rl.whiten_stats(raw, mask)), ret

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None)))  # noqa: E731
    sharded = jax.jit(step)(*(put(x) for x in (r, v, m, seg)))
    assert sharded[0].sharding.spec[0] == "data" or len(sharded[0].sharding.device_set) == 8
    local = step(r, v, m, seg)
    for a, b in zip(sharded, local):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_outcome_token_rewards_sit_on_each_sequences_last_response_token():
    # row 0: seq 1 = positions 0-3 (response 2, 3), seq 2 = 4-6 (response 5 only; 6 is off),
    # pad 7; row 1: one sequence whose response is 1-2
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    m = np.array([[0, 0, 1, 1, 0, 1, 0, 1], [0, 1, 1, 0, 0, 0, 0, 0]], np.float32)
    score = np.array([[0.5] * 4 + [2.0] * 3 + [9.0], [-1.0] * 8])
    out = rl.outcome_token_rewards(score, m, seg)
    np.testing.assert_array_equal(out, [[0, 0, 0, 0.5, 0, 2.0, 0, 0], [0, 0, -1.0, 0, 0, 0, 0, 0]])
    # the GAE of an outcome reward with gamma = lam = 1 and zero values: the score on every
    # response token
    raw, _ = rl.gae_packed(out, np.zeros((2, 8)), m, seg, 1.0, 1.0)
    np.testing.assert_array_equal(raw, [[0, 0, 0.5, 0.5, 0, 2.0, 0, 0],
                                        [0, -1.0, -1.0, 0, 0, 0, 0, 0]])
