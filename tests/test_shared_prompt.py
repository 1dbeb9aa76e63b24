"""The shared-prompt layout (lrl.data.shared_prompt) and its attention
(lrl.models.shared_attention, and the ring over `seq`): a group's prompt once, each response
seeing its own tokens causally and the prompt fully.

B batch rows · T positions · N query heads · K kv heads · H head dim · G samples per prompt.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl.data import packing
from lrl.data import shared_prompt as sp
from lrl.mesh import make_mesh
from lrl.models import ring
from lrl.models import shared_attention as sa


def groups_of(rng, num_groups, G, prompt_len, completion_len, vocab=50):
    """num_groups prompts with G completions each (flat, sample g of group p at p*G + g);
    lengths drawn from the given (low, high) ranges."""
    P = [rng.integers(1, vocab, rng.integers(*prompt_len)) for _ in range(num_groups)]
    prompts = [P[i // G] for i in range(num_groups * G)]
    comps = [rng.integers(1, vocab, rng.integers(*completion_len))
             for _ in range(num_groups * G)]
    return prompts, comps, np.arange(num_groups * G) // G


# ----------------------------------------------------------------------------- the layout

def test_one_group_hand_computed():
    """Prompt [5, 6, 7], completions [1, 2] and [3]: the prefix [5, 6], then [7, 1, 2] and
    [7, 3], positions continuing from the prompt, one segment each, the loss on the
    completion targets, prefix_ids naming the prefix."""
    p = np.array([5, 6, 7])
    b, lay = sp.pack_groups([p, p], [np.array([1, 2]), np.array([3])], 8, groups=[0, 0],
                            share=[True, True], seq_values={"adv": [0.5, -1.0]},
                            token_values={"old": [[-1.0, -2.0], [-3.0]]})
    np.testing.assert_array_equal(b["tokens"], [[5, 6, 7, 1, 2, 7, 3, 0]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3, 4, 2, 3, 0]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 2, 2, 2, 3, 3, 0]])
    np.testing.assert_array_equal(b["prefix_ids"], [[1, 1, 1, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(b["targets"], [[6, 0, 1, 2, 0, 3, 0, 0]])
    np.testing.assert_array_equal(b["loss_mask"], [[0, 0, 1, 1, 0, 1, 0, 0]])
    np.testing.assert_allclose(b["adv"], [[0, 0, 0.5, 0.5, 0.5, -1, -1, 0]])
    np.testing.assert_allclose(b["old"], [[0, 0, -1, -2, 0, -3, 0, 0]])
    np.testing.assert_array_equal(lay["start"], [2, 5])
    np.testing.assert_array_equal(lay["loss_start"], [2, 5])
    np.testing.assert_array_equal(lay["prefix_start"], [0, 0])
    q_pre, kv_pre = sa.prefix_masks(jnp.asarray(b["segment_ids"]), jnp.asarray(b["prefix_ids"]))
    np.testing.assert_array_equal(q_pre, [[-1, -1, 1, 1, 1, 1, 1, -1]])
    np.testing.assert_array_equal(kv_pre, [[1, 1, -2, -2, -2, -2, -2, -2]])


def test_nothing_shared_is_exactly_pack():
    """Groups of one sample (and share all False) give `packing.pack`'s arrays and layout."""
    rng = np.random.default_rng(1)
    prompts, comps, _ = groups_of(rng, 9, 1, (1, 7), (0, 6))
    values = dict(seq_values={"adv": rng.normal(size=9)},
                  token_values={"old": [rng.normal(size=len(c)) for c in comps]})
    want, want_lay = packing.pack(prompts, comps, 16, fit="best", max_segments=4, **values)
    share = sp.share_groups(np.arange(9), [len(p) for p in prompts], [len(c) for c in comps],
                            "on")
    assert not share.any()
    got, lay = sp.pack_groups(prompts, comps, 16, groups=np.arange(9), share=share,
                              max_segments=4, **values)
    assert set(got) == set(want) | {"prefix_ids"} and not got["prefix_ids"].any()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for k in want_lay:
        np.testing.assert_array_equal(np.asarray(lay[k]), np.asarray(want_lay[k]), err_msg=k)


@pytest.mark.parametrize("G,row_len,max_segments,cut", [
    (2, 40, None, None), (5, 24, None, None), (8, 64, 6, None),
    (8, 64, 6, packing.Cut(2, 1, (64, 32, 16)))])
def test_round_trip_chunks_and_bounds(G, row_len, max_segments, cut):
    """Every sequence comes back from the rows (prompt, completion, values); a group too
    long for one row is cut into chunks, each with its prefix; rows hold at most
    max_segments segments; one response alone in a row is an unshared sequence. With a cut
    the last rows are packed short, and a row's tokens still lie from position 0 on."""
    rng = np.random.default_rng(G)
    prompts, comps, groups = groups_of(rng, 5, G, (2, 12), (0, 8))
    tok = {"old": [rng.normal(size=len(c)) for c in comps]}
    adv = rng.normal(size=len(comps))
    share = sp.share_groups(groups, [len(p) for p in prompts], [len(c) for c in comps], "on")
    assert share.all()
    b, lay = sp.pack_groups(prompts, comps, row_len, groups=groups, share=share,
                            seq_values={"adv": adv}, token_values=tok,
                            max_segments=max_segments, cut=cut)
    if cut is not None:
        extents = packing._extents(b["segment_ids"])
        assert ((b["segment_ids"] > 0).sum(axis=1) == extents).all() and extents.min() <= 32
    out = packing.unpack(b, lay)
    for i in range(len(comps)):
        np.testing.assert_array_equal(out["prompts"][i], prompts[i])
        np.testing.assert_array_equal(out["completions"][i], comps[i])
        np.testing.assert_allclose(out["old"][i], tok["old"][i], rtol=1e-6)
        assert out["adv"][i] == pytest.approx(adv[i], rel=1e-6)
    # Each row: the prompt tokens it holds are fewer than its responses' copies would be.
    prompt_tokens = sum(len(p) for p in prompts)
    assert (b["loss_mask"].sum() == sum(len(c) for c in comps))
    held = (b["segment_ids"] > 0).sum()
    assert held < prompt_tokens + sum(len(c) for c in comps)
    if max_segments:
        assert b["segment_ids"].max() <= max_segments
    alone = lay["prefix_start"] < 0
    assert np.array_equal(alone, ~lay["shared"])
    for i in np.flatnonzero(~alone):   # a shared response's prefix lies in its row
        r, ps, p = lay["row"][i], lay["prefix_start"][i], lay["prompt_len"][i]
        seg = b["segment_ids"][r]
        assert (b["prefix_ids"][r, ps:ps + p - 1] == seg[ps]).all()
        assert (b["prefix_ids"][r, lay["start"][i]] == seg[ps])


def test_auto_shares_long_prompts_only_and_errors_are_clear():
    groups = np.array([0, 0, 1, 1, 2])
    share = sp.share_groups(groups, [10, 10, 3, 3, 50], [4, 6, 5, 9, 1], "auto")
    np.testing.assert_array_equal(share, [True, True, False, False, False])
    assert not sp.share_groups(groups, [10, 10, 3, 3, 50], [4, 6, 5, 9, 1], "off").any()
    with pytest.raises(ValueError, match="shared_prompt"):
        sp.share_groups(groups, [1] * 5, [1] * 5, "sometimes")
    p = np.array([1, 2, 3])
    with pytest.raises(ValueError, match="different prompts"):
        sp.pack_groups([p, p + 1], [p, p], 16, groups=[0, 0], share=[True, True])
    with pytest.raises(ValueError, match="shared and unshared"):
        sp.pack_groups([p, p], [p, p], 16, groups=[0, 0], share=[True, False])
    from lrl import options
    assert options.SHARED_PROMPT == sp.MODES   # the config check and the packer agree


# ----------------------------------------------------------------------------- attention

def reference_attention(q, k, v, seg, pre):
    """Materialised scores under the layout's mask: same segment and causal, or a
    response's query on its prefix's keys."""
    B, T, N, H = q.shape
    K = k.shape[2]
    q_pre, kv_pre = sa.prefix_masks(seg, pre)
    idx = jnp.arange(T)
    vis = (((seg[:, :, None] == seg[:, None, :]) & (idx[None, None] <= idx[None, :, None]))
           | (q_pre[:, :, None] == kv_pre[:, None, :]))
    s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k) * H ** -0.5
    p = jax.nn.softmax(jnp.where(vis[:, None, None], s, -jnp.inf), -1)
    return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N, H)


def _rows(seed, G, row_len=48, rows=2):
    rng = np.random.default_rng(seed)
    prompts, comps, groups = groups_of(rng, 4, G, (2, 12), (0, 7))
    share = sp.share_groups(groups, [len(p) for p in prompts], [len(c) for c in comps], "on")
    b, _ = sp.pack_groups(prompts, comps, row_len, groups=groups, share=share,
                          max_segments=30, min_rows=rows, rows_multiple=rows)
    return rng, jnp.asarray(b["segment_ids"]), jnp.asarray(b["prefix_ids"])


def _values_and_grads(fn, q, k, v, do):
    o, vjp = jax.vjp(fn, q, k, v)
    return o, vjp(do)


@pytest.mark.parametrize("G", [1, 3, 6])
@pytest.mark.parametrize("n,path", [(1, "dense"), (2, "ring"), (4, "ring"), (4, "ulysses")])
def test_shared_attention_dense_and_ring_match_the_masked_reference(G, n, path):
    """Values and gradients of q, k, v (fp32): whole rows on one device, the ring over n seq
    shards in the zig-zag layout and Ulysses over n; several groups a row, a group cut over
    rows."""
    rng, seg, pre = _rows(G, G)
    B, T = seg.shape
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v, do = f(B, T, 4, 8), f(B, T, 2, 8), f(B, T, 2, 8), f(B, T, 4, 8)
    want = _values_and_grads(lambda q, k, v: reference_attention(q, k, v, seg, pre), q, k, v, do)
    if path == "dense":
        fn = lambda q, k, v: sa.shared_attention(q, k, v, seg, pre, q_chunk=8, kv_chunk=8)  # noqa
    elif path == "ulysses":
        from lrl.models import ulysses
        mesh = make_mesh({"seq": n, "fsdp": -1})
        fn = lambda q, k, v: ulysses.ulysses_attention(q, k, v, seg, mesh=mesh, q_chunk=8,  # noqa
                                                       kv_chunk=8, prefix_ids_BT=pre)
    else:
        mesh = make_mesh({"seq": n, "fsdp": -1})
        perm = ring.zigzag_permutation(T, n)
        inv = ring.inverse_permutation(perm)

        def fn(q, k, v):
            return ring.ring_attention(q[:, perm], k[:, perm], v[:, perm], seg[:, perm],
                                       mesh=mesh, q_chunk=4, kv_chunk=4,
                                       prefix_ids_BT=pre[:, perm])[:, inv]
    got = jax.jit(lambda q, k, v: _values_and_grads(fn, q, k, v, do))(q, k, v)
    for a, b, name in zip((got[0], *got[1]), (want[0], *want[1]), "oqkv"):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    if G == 1:   # nothing shared: exactly the plain packed attention
        from lrl.models import flash
        np.testing.assert_allclose(got[0], flash.dense_attention(q, k, v, seg), atol=1e-6)


# ----------------------------------------------------------------------------- the update

def _update_batches(seed, G, row_len, rows, vocab, num_groups=3, prompt_len=(3, 14),
                    completion_len=(1, 7)):
    """The same samples packed both ways -> ((unshared rows, layout), (shared rows, layout)),
    with advantages and old / reference / rollout log-probs near a tiny model's."""
    rng = np.random.default_rng(seed)
    prompts, comps, groups = groups_of(rng, num_groups, G, prompt_len, completion_len, vocab)
    tok = {k: [rng.normal(-3.4, 0.2, len(c)) for c in comps]
           for k in ("old_logp", "ref_logp", "rollout_logp")}
    kw = dict(seq_values={"advantages": rng.normal(size=len(comps))}, token_values=tok,
              min_rows=rows, rows_multiple=rows, max_segments=40)
    plain = packing.pack(prompts, comps, row_len, fit="best", **kw)
    share = sp.share_groups(groups, [len(p) for p in prompts], [len(c) for c in comps], "on")
    shared = sp.pack_groups(prompts, comps, row_len, groups=groups, share=share, **kw)
    assert shared[0]["prefix_ids"].any() == (G > 1)
    return plain, shared


LOSSES = {
    "token_mean": dict(aggregation="token_mean", kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0),
    "seq_mean_token_mean": dict(aggregation="seq_mean_token_mean", kl_coef=0.1,
                                kl_estimator="k2", entropy_coef=0.01),
    "seq_mean_token_sum_norm": dict(aggregation="seq_mean_token_sum_norm", max_len=64,
                                    tis_cap=1.5),
    "gspo": dict(ratio_level="sequence", aggregation="seq_mean_token_mean", kl_coef=0.05),
}


def _step(cfg, loss_cfg, batch, mesh=None, num_micro=1, fused_head=True):
    """One SGD(1) step from the same parameters -> (parameter change = -gradient, metrics,
    per-token log-probs [B, T])."""
    import optax

    from lrl import mesh as mesh_lib
    from lrl import models
    from lrl.rl import update as upd
    params = models.init_params(cfg, jax.random.key(0))
    tx = optax.sgd(1.0)
    state = upd.init_train_state(jax.tree.map(jnp.array, params), tx)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    if mesh is not None:
        state = jax.device_put(state, upd.train_state_shardings(cfg, tx, mesh))
        batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh, 2))
    logp = upd.make_logprobs_fn(cfg, mesh, chunk=8)(state.params, batch)
    new, metrics = upd.make_update_fn(cfg, loss_cfg, tx, mesh, num_micro=num_micro, chunk=8,
                                      fused_head=fused_head)(state, batch)
    delta = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new.params, params)
    return delta, jax.device_get(metrics), np.asarray(logp)


def _assert_same_step(plain, shared, cfg, loss_cfg, **kw):
    (pb, pl), (sb, sl) = plain, shared
    d0, m0, lp0 = _step(cfg, loss_cfg, pb, **kw)
    d1, m1, lp1 = _step(cfg, loss_cfg, sb, **kw)
    for a, b in zip(packing.completion_values(lp1, sl), packing.completion_values(lp0, pl)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(d0)) > 1e-3   # it moved
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(d1)[0], jax.tree.leaves(d0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
    # the shared rows hold fewer tokens for the same samples
    assert (sb["segment_ids"] > 0).sum() < (pb["segment_ids"] > 0).sum() or \
        not sb["prefix_ids"].any()


def _tiny(**kw):
    from lrl import models
    return models.tiny_config(**{**dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4,
                                        n_kv_heads=2, head_dim=8, mlp_dim=64), **kw})


@pytest.mark.parametrize("loss,G,row_len,rows", [
    ("token_mean", 1, 32, 4),   # the fast tier's; the rest in the slow
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("gspo", 8, 64, 2), ("seq_mean_token_mean", 2, 48, 2), ("seq_mean_token_sum_norm", 4, 40, 2),
        ("token_mean", 8, 64, 2), ("seq_mean_token_mean", 5, 40, 2)]]])
def test_shared_update_equals_unshared_on_one_device(loss, G, row_len, rows):
    """Loss, metrics, per-token log-probs and parameter gradients (fp32) of the shared layout
    are the unshared layout's: every aggregation, KL, entropy, TIS and GSPO; several groups a
    row and (G=8 in rows of 64) a group cut over rows. G=1 is today's layout."""
    from lrl.rl import LossConfig
    plain, shared = _update_batches(G * 7 + row_len, G, row_len, rows, 32)
    _assert_same_step(plain, shared, _tiny(), LossConfig(**LOSSES[loss]))


def test_shared_update_unfused_head_and_micro_batches():
    from lrl.rl import LossConfig
    plain, shared = _update_batches(3, 4, 48, 4, 32)
    _assert_same_step(plain, shared, _tiny(), LossConfig(**LOSSES["token_mean"]),
                      num_micro=2, fused_head=False)


@pytest.mark.parametrize("attention", [pytest.param("ring", marks=pytest.mark.slow), "ulysses"])
def test_shared_update_equals_unshared_on_fsdp_x_seq(attention):
    """The same over a mesh of fsdp 2 x seq 4: ring attention in the zig-zag layout (a prompt
    prefix spread over several seq shards) and Ulysses."""
    from lrl.rl import LossConfig
    mesh = make_mesh({"fsdp": 2, "seq": 4})
    plain, shared = _update_batches(11, 4, 64, 2, 32, prompt_len=(12, 30))
    _assert_same_step(plain, shared, _tiny(attention=attention),
                      LossConfig(**LOSSES["seq_mean_token_mean"]), mesh=mesh, num_micro=2)


# ----------------------------------------------------------------------------- M-RoPE

def _vl_config():
    from lrl.models import vision, vl
    text = _tiny(model_type="qwen2", vocab_size=160, qkv_bias=True, mrope_section=(1, 1, 2))
    return vl.VLConfig(text, vision.VisionConfig(depth=1, out_hidden_size=32),
                       image_token_id=150, video_token_id=151, vision_start_token_id=152,
                       vision_end_token_id=153)


def _vl_rows(seed, G, share_mode):
    """Two video prompts (table rows 0 and 8; the second ends on its visual tokens), G
    random completions each, packed with `rl.shared_prompt=share_mode` and given their
    visual index and M-RoPE positions -> (rows, layout)."""
    from lrl.models import vl
    from lrl.tasks import Prompt, video
    VL_CFG = _vl_config()
    rng = np.random.default_rng(seed)
    grid = (2, 4, 4)
    n = VL_CFG.tokens_per_item(grid)
    prompts = []
    for tail in ([153] + list(rng.integers(0, 140, 5)), []):
        ids = np.array([3, 152] + [151] * n + tail, np.int32)
        pos, delta = vl.mrope_positions(VL_CFG, ids, video_grids=[grid])
        prompts.append(Prompt(ids, "a", {}, "", visual=video.VisualRows(None, n, pos, delta)))
    comps = [rng.integers(0, 150, rng.integers(2, 8)).astype(np.int32) for _ in range(2 * G)]
    comps[0][1] = VL_CFG.video_token_id          # a sampled pad stays an ordinary token
    groups = np.arange(2 * G) // G
    share = sp.share_groups(groups, [len(prompts[g].ids) for g in groups],
                            [len(c) for c in comps], share_mode)
    rows, layout = sp.pack_groups(
        [prompts[g].ids for g in groups], comps, 64, groups=groups, share=share,
        seq_values={"advantages": rng.normal(size=2 * G)},
        token_values={"old_logp": [rng.normal(-3.4, 0.2, len(c)) for c in comps]},
        rows_multiple=2, max_segments=40)
    if share_mode == "off":
        rows.pop("prefix_ids")
    rows = video.add_visual_rows(VL_CFG, rows, layout, [prompts[g] for g in groups],
                                 [8 * g for g in groups])
    return rows, layout


@pytest.mark.parametrize("G,attention", [(1, "dense"), pytest.param(4, "dense", marks=pytest.mark.slow),
                                         pytest.param(3, "ring", marks=pytest.mark.slow)])
def test_vl_shared_update_equals_unshared_with_mrope(G, attention):
    """The Qwen2.5-VL decoder reading a visual table: the prompt's visual tokens appear once
    in the shared rows, its responses take M-RoPE positions continuing from the prompt's
    end; loss, log-probs and gradients are the unshared layout's (ring: fsdp 2 x seq 4)."""
    import optax

    from lrl import mesh as mesh_lib
    from lrl import models
    from lrl.models import vl
    from lrl.rl import LossConfig
    from lrl.rl import update as upd
    plain, shared = _vl_rows(G, G, "off"), _vl_rows(G, G, "on")
    # once a prompt, but the second prompt's last (visual) token opens each of its responses
    n_vis = 8 + 7 + G if G > 1 else 16
    assert (shared[0]["visual_index"] >= 0).sum() == n_vis
    assert (plain[0]["visual_index"] >= 0).sum() == 2 * 8 * G
    cfg = _vl_config().text.replace(attention=attention)
    mesh = make_mesh({"fsdp": 2, "seq": 4}) if attention == "ring" else None
    table = jax.random.normal(jax.random.key(1), (16, cfg.d_model))
    loss = LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01)
    params = models.init_params(cfg, jax.random.key(0))
    tx = optax.sgd(1.0)
    kw = dict(hidden=vl.batch_hidden_states, extra_keys=("visual_index",), chunk=8)
    out = []
    for rows, layout in (plain, shared):
        state = upd.init_train_state(jax.tree.map(jnp.array, params), tx)
        t = table
        if mesh is not None:
            state = jax.device_put(state, upd.train_state_shardings(cfg, tx, mesh))
            t = jax.device_put(table, mesh_lib.replicated(mesh))
        batch = mesh_lib.put_batch(mesh, rows)
        logp = upd.make_logprobs_fn(cfg, mesh, **kw)(state.params, batch, t)
        new, m = upd.make_update_fn(cfg, loss, tx, mesh, **kw)(state, batch, t)
        out.append((packing.completion_values(np.asarray(logp), layout), jax.device_get(m),
                    jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new.params,
                                 params)))
    (lp0, m0, d0), (lp1, m1, d1) = out
    for a, b in zip(lp1, lp0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(d1), jax.tree.leaves(d0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the loop

@pytest.mark.slow
def test_grpo_loop_with_shared_prompts_end_to_end(tmp_path, monkeypatch):
    """`rl.shared_prompt=on` through `lrl.loop.run` on the tiny default config, with the
    trainer's old log-probs and the reference's (KL) taken on the shared rows: groups are
    shared, the policy moves, the metrics are finite, and from the third step on nothing
    compiles (docs/batching.md: the second step may still compile)."""
    import json

    from lrl import loop
    from tests.test_loop import tiny_config
    shared_rows = []
    pack_groups = sp.pack_groups

    def spy(*a, **k):
        rows, layout = pack_groups(*a, **k)
        shared_rows.append(int(layout["shared"].sum()))
        return rows, layout
    monkeypatch.setattr(sp, "pack_groups", spy)
    cfg = tiny_config(shared_prompt="on", epochs=2, recompute_old_logp=True)
    cfg.rl.loss.kl_coef = 0.01
    cfg.eval.every = 0
    cfg.reward.spec = "test_digits:1.0"      # tests/test_loop.py's dense reward
    loop.run(cfg, str(tmp_path))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    grpo_rows = [r for r in rows if r["phase"] == "grpo" and "loss" in r]
    assert len(grpo_rows) == 3 and shared_rows and min(shared_rows) > 0
    for r in grpo_rows:
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "ratio_mean"):
            assert np.isfinite(r[k]), (k, r[k])
    assert max(abs(r["loss"]) for r in grpo_rows) > 0 and grpo_rows[-1]["kl"] > 0
    assert grpo_rows[-1]["compiles/step"] == 0


def test_minibatches_cut_between_groups_when_shared():
    """With the shared layout a minibatch holds whole groups (the same cut as by samples when
    the minibatch count divides the prompts); unshared, the cut is by samples as before."""
    from lrl import grpo
    by_samples = grpo.minibatch_samples(4, 3, 2, whole_groups=False)
    assert [x.tolist() for x in grpo.minibatch_samples(4, 3, 2, whole_groups=True)] == \
        [x.tolist() for x in by_samples]
    got = grpo.minibatch_samples(3, 4, 2, whole_groups=True)
    assert [x.tolist() for x in got] == [list(range(8)), list(range(8, 12))]
    assert [len(x) for x in grpo.minibatch_samples(3, 4, 2, whole_groups=False)] == [6, 6]
    # fewer groups than minibatches: by samples, each part shared within its minibatch
    assert [len(x) for x in grpo.minibatch_samples(1, 4, 2, whole_groups=True)] == [2, 2]


@pytest.mark.slow
def test_video_grpo_loop_with_shared_prompts(tmp_path, monkeypatch):
    """`rl.shared_prompt=on` for the video task: each group's visual prompt is held once in
    its row (visual rows and M-RoPE positions in the prefix), and the trainer's log-probs of
    those rows are still the sampler's (ratio 1, as for unshared rows in test_video_grpo)."""
    from lrl import loop
    from lrl.rewards import register
    from tests.test_video_grpo import _config

    @register("test_video_len_shared")
    def _length_reward(completion, answer, **meta):
        return float(len(completion) % 3)

    shared = []
    pack_groups = sp.pack_groups

    def spy(*a, **k):
        rows, layout = pack_groups(*a, **k)
        shared.append(int(layout["shared"].sum()))
        return rows, layout
    monkeypatch.setattr(sp, "pack_groups", spy)
    c = _config("runlocal")
    c.reward.spec = "video:1.0,test_video_len_shared:0.5"
    c.rl.steps, c.rl.prompts_per_step, c.rl.group_size = 2, 2, 4
    c.rl.shared_prompt = "on"
    c.eval.every = 0
    m = loop.run(c, str(tmp_path))["grpo"]
    assert shared and min(shared) > 0 and m["pack/shared_frac"] > 0
    assert all(np.isfinite(x) for x in m.values())
    assert m["grad_norm"] > 0
    assert abs(m["ratio_max"] - 1) < 1e-4 and abs(m["ratio_min"] - 1) < 1e-4
