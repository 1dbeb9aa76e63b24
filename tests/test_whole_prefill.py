"""The whole-prompt prefill (`EngineConfig.prefill_lengths`): a prompt longer than the prefill
chunk in one [1, L] packed call writes the pages that chunk after chunk through the paged path
writes, text and video (embeddings + M-RoPE) alike, and decodes the same first tokens with the
same log-probs (fp32); its lengths compile with the engine, so later prompts compile nothing."""
import jax
import numpy as np
import pytest

from lrl import models
from lrl.models import vl
from lrl.rollout import Engine, EngineConfig, SamplingParams, engine_config
from lrl.rollout import steps
from lrl.rollout.steps import whole_prefill_lengths
from tests.test_video_mesh import GRID, TEXT, VL   # the tiny VL policy and its video grid

SIZES = dict(page_size=4, num_pages=96, max_slots=4, max_pages_per_slot=16, prefill_chunk=8,
             prefill_block_pages=2, decode_block_pages=2, sampling=SamplingParams(0.0))


@pytest.fixture(scope="module")
def params():
    p = models.init_params(TEXT, jax.random.key(0))
    return jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, p)   # varied greedy samples


def _video(params, n_text: int, seed: int):
    """A video prompt: ids, input embeddings [T, D] (a random visual table spliced in), M-RoPE
    positions [3, T]."""
    rng = np.random.default_rng(seed)
    ids = np.array([3, 152] + [151] * VL.tokens_per_item(GRID) + [153]
                   + list(rng.integers(0, 140, n_text)), np.int32)
    pos, _ = vl.mrope_positions(VL, ids, video_grids=[GRID])
    table = jax.random.normal(jax.random.key(seed), (8, TEXT.d_model))
    embeds = vl.embed_tokens(TEXT, params, ids[None], table, vl.visual_index(VL, ids[None]))[0]
    return ids, embeds, pos


def _prefill_and_decode(params, ecfg, prompts):
    """-> (the prompts' K and V pages, greedy tokens [3, n] and log-probs after them, the
    [R, C] shapes of the packed calls, the number of chunk calls)."""
    engine = Engine(TEXT, ecfg)
    dparams = engine.decode_params(params)
    packed, chunks = [], []
    call, chunk = engine._packed_call, engine._prefill_call
    engine._packed_call = lambda *a, **k: packed.append((a[4], a[5])) or call(*a, **k)
    engine._prefill_call = lambda *a, **k: chunks.append(a[4]) or chunk(*a, **k)
    prefixes = [engine.reserve_prefix(*p) for p in prompts]
    state = engine.run_prefill(dparams, engine.init_decode_state(), prefixes)
    used = [layer * ecfg.num_pages + q for layer in range(TEXT.n_layers)
            for p in prefixes for q in p.pages]
    pages = np.asarray(state.k_pages)[:, used], np.asarray(state.v_pages)[:, used]
    for slot, pre in enumerate(prefixes):
        state = engine.insert(pre, state, [slot], max_new_tokens=3, last=True)
    state, out = engine.generate(dparams, state, jax.random.key(0), num_steps=3)
    n = len(prompts)
    return pages, np.asarray(out.tokens)[:, :n], np.asarray(out.logps)[:, :n], packed, chunks


def test_whole_prompt_prefill_writes_what_chunks_write(params):
    text = (np.arange(37) * 7 % 150).astype(np.int32)           # 36 cached: 5 chunks of 8
    ids, embeds, pos = _video(params, 21, seed=1)                # 32 tokens, 31 cached
    short = np.array([5, 9, 11, 4, 6], np.int32)                 # fits one chunk
    prompts = [(text,), (ids, embeds, pos), (short,)]
    lengths = whole_prefill_lengths(8, 36, 64)
    assert lengths == (16, 32, 40)
    want = _prefill_and_decode(params, EngineConfig(**SIZES), prompts)
    got = _prefill_and_decode(params, EngineConfig(prefill_lengths=lengths, **SIZES), prompts)
    assert want[4] and not got[4]                  # chunks before, none with whole prompts
    assert (1, 40) in got[3] and (1, 32) in got[3]  # the text prompt's call, the video's
    for w, g in zip(want[0], got[0]):
        assert np.abs(w).sum() > 0
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], atol=1e-5, rtol=1e-5)
    assert len(set(want[1][0].tolist())) > 1       # the prompts' first tokens differ


def test_whole_prefill_lengths_compile_with_the_engine(params):
    """A few lengths (powers of two of the chunk, then the longest prompt rounded up), none
    above the call's token budget; `compile_prefill` compiles them for the run's kind of
    prompt, after which prompts of any length compile no prefill program."""
    assert whole_prefill_lengths(4096, 32_802, 1 << 20) == (8192, 16384, 32768, 33792)
    assert whole_prefill_lengths(4096, 8_225, 16384) == (8192, 9216)
    assert whole_prefill_lengths(4096, 9_000, 8192) == (8192,)
    assert whole_prefill_lengths(4096, 4_000, 1 << 20) == ()     # every prompt fits a chunk
    assert whole_prefill_lengths(4096, 9_000, 4096) == ()        # the budget is one chunk
    kw = dict(max_prompt_len=40, max_new_tokens=4, max_slots=4, num_pages=96, page_size=4,
              prefill_chunk=8, prefill_tokens=64, prefill_block_pages=2, decode_block_pages=2)
    ecfg = engine_config(TEXT, **kw)
    assert ecfg.prefill_lengths == (16, 32, 40)
    assert engine_config(TEXT, whole_prefill=False, **kw).prefill_lengths == ()
    with pytest.raises(ValueError, match="prefill_lengths"):
        EngineConfig(prefill_chunk=8, prefill_lengths=(8, 16))
    engine = Engine(TEXT, ecfg)
    dparams = engine.decode_params(params)
    state = engine.compile_prefill(dparams, engine.init_decode_state(), multimodal=True)
    compiled = steps.prefill_packed._cache_size()
    for n_text, seed in ((5, 2), (14, 3), (29, 4)):              # 15, 24, 39 tokens
        pre = engine.reserve_prefix(*_video(params, n_text, seed))
        state = engine.run_prefill(dparams, state, [pre])
        engine.release(pre)
    assert steps.prefill_packed._cache_size() == compiled
