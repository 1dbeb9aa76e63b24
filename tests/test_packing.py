"""Packing of (prompt, completion) sequences into fixed rows: hand-built cases and round trips."""
import numpy as np
import pytest

from lrl.data import packing


def test_two_sequences_in_one_row_hand_computed():
    batch, layout = packing.pack(
        [[5, 6], [7]], [[8, 9, 10], [11, 12]], row_len=8,
        seq_values={"advantages": [0.5, -1.0]},
        token_values={"old_logp": [[-0.1, -0.2, -0.3], [-0.4, -0.5]]})
    np.testing.assert_array_equal(batch["tokens"], [[5, 6, 8, 9, 10, 7, 11, 12]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 4, 0, 1, 2]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 1, 1, 2, 2, 2]])
    np.testing.assert_array_equal(batch["targets"], [[6, 8, 9, 10, 0, 11, 12, 0]])
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 1, 1, 1, 0, 1, 1, 0]])
    np.testing.assert_allclose(batch["advantages"], [[0.5] * 5 + [-1.0] * 3])
    np.testing.assert_allclose(batch["old_logp"], [[0, -0.1, -0.2, -0.3, 0, -0.4, -0.5, 0]],
                               rtol=1e-6)
    assert batch["tokens"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
    assert layout["num_truncated"] == 0


def test_first_fit_decreasing_placement_and_row_padding():
    # Lengths 4, 3, 2, 5 into rows of 6: 5 -> row 0; 4 -> row 1; 3 -> new row 2;
    # 2 fits next to the 4 in row 1. Three rows, padded to a multiple of 4.
    prompts = [[1, 2], [3], [4], [5, 6, 7]]
    completions = [[8, 9], [10, 11], [12], [13, 14]]
    batch, layout = packing.pack(prompts, completions, row_len=6, rows_multiple=4)
    np.testing.assert_array_equal(layout["row"], [1, 2, 1, 0])
    np.testing.assert_array_equal(layout["start"], [0, 0, 4, 0])
    assert batch["tokens"].shape == (4, 6)
    np.testing.assert_array_equal(batch["tokens"][1], [1, 2, 8, 9, 4, 12])
    np.testing.assert_array_equal(batch["segment_ids"][1], [1, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(batch["targets"][1], [2, 8, 9, 0, 12, 0])
    np.testing.assert_array_equal(batch["loss_mask"][1], [0, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(batch["segment_ids"][0], [1, 1, 1, 1, 1, 0])
    for key in ("tokens", "segment_ids", "loss_mask", "positions", "targets"):
        assert not batch[key][3].any(), key  # the padding row
    batch, _ = packing.pack(prompts, completions, row_len=6, min_rows=5, rows_multiple=2)
    assert batch["tokens"].shape == (6, 6)


def test_too_long_raises_or_truncates_and_counts():
    with pytest.raises(ValueError, match="sequence 1 has 3 prompt \\+ 5 completion"):
        packing.pack([[1], [1, 2, 3]], [[2], [4, 5, 6, 7, 8]], row_len=6)
    batch, layout = packing.pack([[1], [1, 2, 3]], [[2], [4, 5, 6, 7, 8]], row_len=6,
                                 truncate=True, token_values={"lp": [[0.1], [1, 2, 3, 4, 5]]})
    assert layout["num_truncated"] == 1 and layout["truncated_tokens"] == 2
    out = packing.unpack(batch, layout)
    np.testing.assert_array_equal(out["completions"][1], [4, 5, 6])
    np.testing.assert_allclose(out["lp"][1], [1, 2, 3])
    with pytest.raises(ValueError, match="prompt 0 has 6 tokens"):
        packing.pack([[1] * 6], [[2]], row_len=6, truncate=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[]], completions=[[1]]), "prompt 0 is empty"),
    (dict(prompts=[[1]], completions=[[1], [2]]), "1 prompts but 2 completions"),
    (dict(prompts=[[1]], completions=[[2]], seq_values={"tokens": [1.0]}), "clashes"),
    (dict(prompts=[[1]], completions=[[2, 3]], token_values={"lp": [[0.1]]}),
     "'lp' of sequence 0 have 1 entries for 2"),
    (dict(prompts=[[1]], completions=[[2]], seq_values={"adv": [1.0, 2.0]}), "2 entries"),
    (dict(prompts=[[1.5]], completions=[[2]]), "prompt 0 must be a 1-D integer"),
])
def test_bad_input_names_the_culprit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        packing.pack(row_len=8, **kwargs)


def _check_invariants(batch):
    tok, seg, pos, tgt = batch["tokens"], batch["segment_ids"], batch["positions"], batch["targets"]
    same_next = np.zeros_like(seg, bool)
    same_next[:, :-1] = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0)
    want_tgt = np.where(same_next, np.roll(tok, -1, axis=1), 0)
    np.testing.assert_array_equal(tgt, want_tgt)
    starts = (seg > 0) & np.concatenate([np.ones_like(seg[:, :1], bool),
                                         seg[:, 1:] != seg[:, :-1]], axis=1)
    assert (pos[starts] == 0).all()
    inner = (seg > 0) & ~starts
    assert (pos[inner] == np.roll(pos, 1, axis=1)[inner] + 1).all()
    assert (batch["loss_mask"][seg == 0] == 0).all() and (tok[seg == 0] == 0).all()


def test_random_round_trip():
    rng = np.random.default_rng(0)
    n = 37
    prompts = [rng.integers(1, 100, rng.integers(1, 20)) for _ in range(n)]
    completions = [rng.integers(1, 100, rng.integers(0, 30)) for _ in range(n)]
    adv = rng.normal(size=n).astype(np.float32)
    logp = [-rng.random(len(c)).astype(np.float32) for c in completions]
    batch, layout = packing.pack(prompts, completions, row_len=64, rows_multiple=8,
                                 seq_values={"advantages": adv}, token_values={"old_logp": logp})
    assert batch["tokens"].shape[0] % 8 == 0
    _check_invariants(batch)
    assert batch["loss_mask"].sum() == sum(len(c) for c in completions)
    # Targets under the mask are exactly the completion tokens, in order.
    np.testing.assert_array_equal(np.sort(batch["targets"][batch["loss_mask"] > 0]),
                                  np.sort(np.concatenate(completions)))
    out = packing.unpack(batch, layout)
    for i in range(n):
        np.testing.assert_array_equal(out["prompts"][i], prompts[i])
        np.testing.assert_array_equal(out["completions"][i], completions[i])
        np.testing.assert_allclose(out["old_logp"][i], logp[i])
        assert out["advantages"][i] == pytest.approx(adv[i])
    # FFD is not worse than one sequence per row and uses the rows well here.
    total = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    assert int(layout["row"].max()) + 1 <= -(-total // 64) + 2


@pytest.mark.parametrize("shards,rows_per_shard", [(1, 2), (3, 1), (2, 3)])
def test_best_fit_with_a_cut_packs_the_last_rows_short_and_round_trips(shards, rows_per_shard):
    """Best fit given a cut: the rows that stay whole come first, in micro-batches of whole
    rows a shard; the rest hold their tokens from position 0 in rows no longer than their
    micro-batch's length; every sequence comes back; fewer positions are computed than
    with the full rows alone, and no more than with best fit's rows cut short."""
    rng = np.random.default_rng(shards * 10 + rows_per_shard)
    n = 120
    prompts = [rng.integers(1, 100, rng.integers(1, 20)) for _ in range(n)]
    completions = [rng.integers(1, 100, rng.integers(0, 60)) for _ in range(n)]
    logp = [-rng.random(len(c)).astype(np.float32) for c in completions]
    cut = packing.Cut(shards, rows_per_shard, (128, 64, 32))
    kw = dict(seq_values={"advantages": rng.normal(size=n)}, token_values={"old_logp": logp},
              fit="best", max_segments=6)
    batch, layout = packing.pack(prompts, completions, 128, cut=cut, **kw)
    _check_invariants(batch)
    seg = batch["segment_ids"]
    assert ((seg > 0).sum(axis=1) == packing._extents(seg)).all()   # from position 0 on
    assert seg.max() <= 6 and (seg > 0).any(axis=1).all()           # no empty row left
    out = packing.unpack(batch, layout)
    for i in range(n):
        np.testing.assert_array_equal(out["prompts"][i], prompts[i])
        np.testing.assert_array_equal(out["completions"][i], completions[i])
        np.testing.assert_allclose(out["old_logp"][i], logp[i])
    plain, _ = packing.pack(prompts, completions, 128, **kw)
    full = packing.Cut(shards, rows_per_shard, (128,))
    slots = [sum(mb["tokens"].size for mb in packing.micro_batches(b, c))
             for b, c in ((plain, full), (plain, cut), (batch, cut))]
    assert slots[0] >= slots[1] >= slots[2] and slots[0] > slots[2], slots
    micro = packing.micro_batches(batch, cut)
    assert sum(int((mb["segment_ids"] > 0).sum()) for mb in micro) == int((seg > 0).sum())
    assert {mb["tokens"].shape for mb in micro} <= {(shards * k, L) for k, L in cut.shapes()}
    with pytest.raises(ValueError, match="cut only with fit='best'"):
        packing.pack(prompts, completions, 128, cut=cut)
    with pytest.raises(ValueError, match="the cut's rows are 128 tokens, not row_len 256"):
        packing.best_fit([3, 4], 256, cut=cut)
    with pytest.raises(ValueError, match="decreasing positive lengths"):
        packing.Cut(1, 1, (64, 64))


def test_first_fit_bounded_rows_and_sft_pack():
    row, start = packing.first_fit([4, 4, 4, 2], row_len=6, decreasing=False, max_rows=2)
    np.testing.assert_array_equal(row, [0, 1, -1, 0])
    np.testing.assert_array_equal(start, [0, 0, -1, 4])
    batch, layout = packing.sft_pack([[1, 2, 3]], [[4, 5, 3]], row_len=8)
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(batch["targets"], [[2, 3, 4, 5, 3, 0, 0, 0]])
    assert layout["seq_keys"] == () and layout["token_keys"] == ()
