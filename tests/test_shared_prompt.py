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


@pytest.mark.parametrize("G,row_len,max_segments", [(2, 40, None), (5, 24, None),
                                                   (8, 64, 6)])
def test_round_trip_chunks_and_bounds(G, row_len, max_segments):
    """Every sequence comes back from the rows (prompt, completion, values); a group too
    long for one row is cut into chunks, each with its prefix; rows hold at most
    max_segments segments; one response alone in a row is an unshared sequence."""
    rng = np.random.default_rng(G)
    prompts, comps, groups = groups_of(rng, 5, G, (2, 12), (0, 8))
    tok = {"old": [rng.normal(size=len(c)) for c in comps]}
    adv = rng.normal(size=len(comps))
    share = sp.share_groups(groups, [len(p) for p in prompts], [len(c) for c in comps], "on")
    assert share.all()
    b, lay = sp.pack_groups(prompts, comps, row_len, groups=groups, share=share,
                            seq_values={"adv": adv}, token_values=tok,
                            max_segments=max_segments)
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
