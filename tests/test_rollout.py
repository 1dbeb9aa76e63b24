"""The rollout engine on tiny random HF models: greedy decoding against transformers' generate,
log-probs against the training forward, shared prompt pages, continuous batching, chunked
prefill, seeds, pool errors and a sharded run."""
import contextlib

import jax
import numpy as np
import pytest
import torch

import lrl.models as models
import lrl.rollout as rollout
from lrl import mesh as mesh_lib
from lrl.rollout.engine import Engine, EngineConfig
from tests.hf_util import make_hf_model
from tests.test_pages import _np_filtered_logp

# Small pages, chunks and blocks so that prompts cross pages, a prompt is chunked (not one
# whole-prompt call: `test_whole_prompt_prefill_writes_what_chunks_write` compares the two),
# attention loops over several page blocks and more samples wait than there are slots.
SMALL = dict(page_size=4, prefill_chunk=8, steps_per_call=4, prefill_block_pages=2,
             decode_block_pages=2, whole_prefill=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            torch_model = make_hf_model(family, path)
            cfg, params = models.load_hf(str(path))
            made[family] = (torch_model, cfg, params, path)
        return made[family]
    return get


def _prompts(cfg, lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, cfg.vocab_size, size=n).astype(np.int32) for n in lengths]


def _forward_logits(cfg, params, prompts, samples):
    """Rows of the training forward's logits that predicted each sample's tokens, from one
    right-padded batch (causal attention keeps the padding out of view)."""
    seqs = [np.concatenate([p, t]) for p, ss in zip(prompts, samples) for t, _ in ss]
    batch = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s
    logits = np.asarray(models.forward(cfg, params, batch))
    rows, i = [], 0
    for p, ss in zip(prompts, samples):
        rows.append([logits[i + j, len(p) - 1:len(p) - 1 + len(t)] for j, (t, _) in enumerate(ss)])
        i += len(ss)
    return rows


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tiny, family):
    torch_model, cfg, params, _ = tiny(family)
    # 12 tokens > prefill_chunk 8: chunked; 9 - 1 = 8 cached: full pages only; 1: no prefill.
    prompts = _prompts(cfg, [5, 12, 1, 9])
    n = 6
    outs = rollout.generate(cfg, params, prompts, max_new_tokens=n, num_samples=2, max_slots=3,
                            eos_ids=cfg.eos_token_ids, **SMALL)
    ref_rows = _forward_logits(cfg, params, prompts, outs)
    for prompt, samples, rows_g in zip(prompts, outs, ref_rows):
        with torch.no_grad():
            want = torch_model.generate(
                torch.as_tensor(prompt[None], dtype=torch.long), do_sample=False,
                max_new_tokens=n, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                pad_token_id=0).numpy()[0, len(prompt):]
        assert len(samples) == 2
        for (tokens, logps), rows in zip(samples, rows_g):
            np.testing.assert_array_equal(tokens, want)
            rows = _log_softmax(rows)
            np.testing.assert_allclose(logps, rows[np.arange(len(tokens)), tokens], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_decode_kernel_matches_xla_path(tiny, family):
    """The fused kernel (bias, Qwen3's q/k norm, RoPE, page write, attention; interpreted on
    CPU) decodes what the XLA path decodes, over page-crossing prompts and shared pages."""
    from lrl.rollout.steps import EngineConfig, _fuses_decode
    from lrl.rollout.weights import decode_params
    _, cfg, params, _ = tiny(family)
    fused = EngineConfig(attention_impl="pallas_gqa_interpret", fused_decode=True)
    assert _fuses_decode(fused, decode_params(cfg, params))
    assert not _fuses_decode(EngineConfig(attention_impl="pallas_gqa_interpret"),
                             decode_params(cfg, params))
    assert not _fuses_decode(fused, params)          # the training layout's split q/k/v
    prompts = _prompts(cfg, [5, 12, 1, 9], seed=4)
    kw = dict(max_new_tokens=6, num_samples=2, max_slots=3, **SMALL)
    want = rollout.generate(cfg, params, prompts, attention_impl="xla", **kw)
    got = rollout.generate(cfg, params, prompts, attention_impl="pallas_gqa_interpret",
                           fused_decode=True, **kw)
    for a, b in zip(want, got):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-5)


@pytest.mark.slow
def test_end_token_stops_each_sample_where_it_appears(tiny):
    """Samples stop at different calls. With 9 slots no prompt waits, so the host collects
    each decode call while the next one runs; with 2 slots it collects each at once."""
    _, cfg, params, _ = tiny("qwen2")
    prompts = _prompts(cfg, [5, 12, 1, 9], seed=3)
    kw = dict(max_new_tokens=11, num_samples=2, **SMALL)
    free = rollout.generate(cfg, params, prompts, max_slots=9, **kw)
    tokens = [t for s in free for t, _ in s]
    # An end token that some samples produce early and others late or never.
    firsts = {}
    for t in tokens:
        for i, tok in enumerate(t.tolist()):
            firsts.setdefault(tok, []).append(i)
    eos = max(firsts, key=lambda tok: (len(set(firsts[tok])), -min(firsts[tok])))
    stops = set()
    for slots in (9, 2):
        stats = {}
        outs = rollout.generate(cfg, params, prompts, max_slots=slots, eos_ids=[eos],
                                stats=stats, **kw)
        for full_g, cut_g in zip(free, outs):
            for (full, full_logp), (cut, cut_logp) in zip(full_g, cut_g):
                hit = np.flatnonzero(full == eos)
                n = hit[0] + 1 if len(hit) else len(full)
                stops.add(n)
                np.testing.assert_array_equal(cut, full[:n])
                np.testing.assert_allclose(cut_logp, full_logp[:n], atol=1e-5)
        assert stats["new_tokens"] == sum(len(t) for s in outs for t, _ in s)
    assert len(stops) > 1


@pytest.mark.slow
def test_sampled_logps_match_forward_and_seeds_repeat(tiny):
    _, cfg, params, _ = tiny("qwen3")
    prompts = _prompts(cfg, [7, 3, 10], seed=1)
    kw = dict(max_new_tokens=5, num_samples=3, temperature=1.0, max_slots=4, **SMALL)
    outs = rollout.generate(cfg, params, prompts, seed=7, **kw)
    for samples, rows_g in zip(outs, _forward_logits(cfg, params, prompts, outs)):
        for (tokens, logps), rows in zip(samples, rows_g):
            assert tokens.dtype == np.int32 and logps.dtype == np.float32
            assert len(tokens) == 5
            rows = _log_softmax(rows)
            np.testing.assert_allclose(logps, rows[np.arange(5), tokens], atol=1e-4)
    again = rollout.generate(cfg, params, prompts, seed=7, **kw)
    for a, b in zip(outs, again):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(la, lb)
    # A sample's tokens do not depend on the slot it runs in or on what else is admitted
    # with it: with 9 slots every prompt and all its samples go in at once.
    wide = rollout.generate(cfg, params, prompts, seed=7, **{**kw, "max_slots": 9})
    for a, b in zip(outs, wide):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-5)
    other = rollout.generate(cfg, params, prompts, seed=8, **kw)
    flat = lambda o: np.concatenate([t for s in o for t, _ in s])  # noqa: E731
    assert not np.array_equal(flat(outs), flat(other))
    assert len({tuple(t) for s in outs for t, _ in s}) > 3   # samples of a prompt differ


def test_engine_shares_prompt_pages_and_frees_them(tiny):
    _, cfg, params, _ = tiny("qwen2")
    # Asking for the Pallas GPU kernel on CPU exercises the engine's fallback to XLA.
    ecfg = EngineConfig(page_size=4, num_pages=40, max_slots=4, max_pages_per_slot=8,
                        prefill_chunk=16, prefill_block_pages=2, decode_block_pages=2,
                        pallas_k_splits=1, attention_impl="pallas")
    engine = Engine(cfg, ecfg)
    state = engine.init_decode_state()
    prompt = _prompts(cfg, [11])[0]                # 10 cached tokens: 2 full pages + 2 of 4
    prefix, state = engine.prefill(params, state, prompt)
    full, partial = prefix.full_pages, prefix.pages[-1]
    assert len(full) == 2 and prefix.partial
    state = engine.insert(prefix, state, [0, 2], max_new_tokens=5)
    assert engine.pool.refcount[full].tolist() == [3, 3]   # prefix + 2 samples
    assert engine.pool.refcount[partial] == 1
    rows = [engine.slot_pages[s] for s in (0, 2)]
    assert all(r[:2] == full for r in rows)
    own = [p for r in rows for p in r[2:]]
    assert len(own) == len(set(own)) == 2 * 2 and partial not in own
    kp = np.asarray(state.k_pages)
    P = ecfg.num_pages
    for r in rows:   # each sample got a copy of the partial page, in every layer
        for layer in range(cfg.n_layers):
            np.testing.assert_array_equal(kp[:, layer * P + r[2], :2], kp[:, layer * P + partial, :2])
    # The last sample takes the partial page over instead of copying it.
    state = engine.insert(prefix, state, [3], sample_ids=[2], max_new_tokens=5, last=True)
    assert engine.slot_pages[3][:3] == full + [partial]
    assert engine.pool.refcount[full].tolist() == [4, 4]
    with pytest.raises(ValueError, match="last sample"):
        engine.insert(prefix, state, [1], max_new_tokens=5)
    engine.release(prefix)
    assert engine.pool.refcount[partial] == 1 and engine.pool.refcount[full].tolist() == [3, 3]
    on_gpu = jax.default_backend() == "gpu"
    with contextlib.nullcontext() if on_gpu else pytest.warns(UserWarning, match="XLA path"):
        state, out = engine.generate(params, state, jax.random.key(0), num_steps=6)
    assert on_gpu or (engine.ecfg.attention_impl == "xla" and engine.fallback)
    valid = np.asarray(out.valid)
    assert valid[:, [0, 2, 3]].sum(0).tolist() == [5, 5, 5] and not valid[:, 1].any()
    tokens = np.asarray(out.tokens)[:5]
    np.testing.assert_array_equal(tokens[:, 0], tokens[:, 2])   # greedy: samples agree
    np.testing.assert_array_equal(tokens[:, 0], tokens[:, 3])
    assert not np.asarray(state.active).any()
    state = engine.free(state, [0, 2, 3])
    assert engine.pool.all_free()
    with pytest.raises(ValueError, match="not in use"):
        engine.free(state, [0])


def test_chunked_prefill_equals_one_shot(tiny):
    _, cfg, params, _ = tiny("llama")
    prompt = _prompts(cfg, [23], seed=3)[0]        # 22 cached tokens
    caches = []
    for chunk in (4, 32):
        ecfg = EngineConfig(page_size=4, num_pages=12, max_slots=1, max_pages_per_slot=8,
                            prefill_chunk=chunk, prefill_block_pages=2, decode_block_pages=2)
        engine = Engine(cfg, ecfg)
        prefix, state = engine.prefill(params, engine.init_decode_state(), prompt)
        P = ecfg.num_pages
        idx = np.array([[layer * P + p for p in prefix.pages] for layer in range(cfg.n_layers)])
        k = np.asarray(state.k_pages)[:, idx].reshape(cfg.n_kv_heads, cfg.n_layers, -1,
                                                       cfg.head_dim)[:, :, :22]
        v = np.asarray(state.v_pages)[:, idx].reshape(k.shape[:2] + (-1, cfg.head_dim))[:, :, :22]
        caches.append((k, v))
    (k4, v4), (k32, v32) = caches
    assert np.abs(k32).sum() > 0
    np.testing.assert_allclose(k4, k32, atol=1e-5)
    np.testing.assert_allclose(v4, v32, atol=1e-5)


def test_short_prompts_share_prefill_rows_in_calls_of_one_shape(tiny):
    """Six prompts of 3 to 16 tokens packed first-fit into rows of 16 (four rows), two rows a
    call: two calls of one [2, 16] shape; the pages equal those of one row a call; with the
    shape fixed (prefill_rows), other lengths compile nothing new."""
    from lrl.rollout import steps
    _, cfg, params, _ = tiny("qwen2")
    prompts = _prompts(cfg, [9, 12, 16, 4, 7, 3], seed=5)   # 8, 11, 15, 3, 6, 2 cached
    runs = []
    for batch_tokens in (32, 16):
        ecfg = EngineConfig(page_size=4, num_pages=40, max_slots=6, max_pages_per_slot=8,
                            prefill_chunk=16, prefill_batch_tokens=batch_tokens,
                            prefill_block_pages=2, decode_block_pages=2)
        engine = Engine(cfg, ecfg)
        calls = []
        call = engine._packed_call
        engine._packed_call = lambda *a, **k: calls.append([len(r) for r in a[3]]) or call(*a, **k)
        prefixes = [engine.reserve_prefix(p) for p in prompts]
        state = engine.run_prefill(engine.decode_params(params), engine.init_decode_state(),
                                   prefixes)
        runs.append((calls, [np.asarray(state.k_pages)[:, pre.pages] for pre in prefixes]))
    # first fit of 8, 11, 15, 3, 6, 2 into 16: rows 8+3+2 | 11 | 15 | 6
    assert runs[0][0] == [[3, 1], [1, 1]]
    assert sum(len(c) for c in runs[1][0]) == 4 and all(len(c) == 1 for c in runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    engine = Engine(cfg, EngineConfig(page_size=4, num_pages=40, max_slots=6,
                                      max_pages_per_slot=8, prefill_chunk=16, prefill_rows=2,
                                      prefill_block_pages=2, decode_block_pages=2))
    counts = []
    for lengths in ([5, 6], [16, 2, 9, 13, 4]):   # other lengths, the same call shape
        pre = [engine.reserve_prefix(p) for p in _prompts(cfg, lengths, seed=7)]
        engine.run_prefill(engine.decode_params(params), engine.init_decode_state(), pre)
        engine.pool.release([q for p in pre for q in p.holds])
        counts.append(steps.prefill_packed._cache_size())
    assert counts[1] == counts[0]   # nothing new compiled for the second batch
    with pytest.raises(ValueError, match="prefill_batch_tokens must be >= 1"):
        EngineConfig(prefill_batch_tokens=0)


def _prefill_calls(cfg, params, ecfg: EngineConfig, batches, seed: int):
    """Prefills each batch of prompt lengths with an engine of `ecfg` whose prefill shapes are
    compiled first -> (each batch's pages, the [R, C] of every packed call); asserts that no
    call compiled anything after `compile_prefill`."""
    from lrl.rollout import steps
    engine = Engine(cfg, ecfg)
    dparams = engine.decode_params(params)
    state = engine.compile_prefill(dparams, engine.init_decode_state())
    compiled = steps.prefill_packed._cache_size()
    call, shapes, pages = engine._packed_call, [], []
    engine._packed_call = lambda *a, **k: shapes.append((a[4], a[5])) or call(*a, **k)
    for lengths in batches:
        pre = [engine.reserve_prefix(p) for p in _prompts(cfg, lengths, seed=seed)]
        state = engine.run_prefill(dparams, state, pre)
        pages.append([np.asarray(state.k_pages)[:, p.pages] for p in pre])
        engine.pool.release([q for p in pre for q in p.holds])
    assert steps.prefill_packed._cache_size() == compiled   # compiled with the engine
    return pages, shapes


def _same_pages(a, b):
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            np.testing.assert_allclose(u, v, atol=1e-5)


def test_few_prompts_prefill_in_narrow_calls_compiled_with_the_engine(tiny):
    """With prefill_narrow_rows, prompts that fill no more packed rows than that go in a
    narrower call: the same pages as in a call of every row; `compile_prefill` compiles both
    shapes up front, so neither kind of call compiles later."""
    _, cfg, params, _ = tiny("qwen2")
    kw = dict(page_size=4, num_pages=40, max_slots=6, max_pages_per_slot=8, prefill_chunk=16,
              prefill_rows=4, prefill_block_pages=2, decode_block_pages=2)
    batches = ([9], [9, 12, 16, 4, 7, 3])   # one row; four rows
    wide, wide_shapes = _prefill_calls(cfg, params, EngineConfig(**kw), batches, 5)
    narrow, narrow_shapes = _prefill_calls(cfg, params, EngineConfig(prefill_narrow_rows=1, **kw),
                                           batches, 5)
    assert (wide_shapes, narrow_shapes) == ([(4, 16)] * 2, [(1, 16), (4, 16)])
    _same_pages(wide, narrow)
    with pytest.raises(ValueError, match="prefill_narrow_rows"):
        EngineConfig(prefill_rows=4, prefill_narrow_rows=4)


def test_few_short_prompts_prefill_in_short_calls(tiny):
    """With prefill_short_chunk S, short text prompts that pack into few rows of S go in calls
    [1, S], one a row, writing the same pages as calls of C; more rows, or a longer prompt,
    take the C-wide calls. `compile_prefill` compiles [1, S] with the engine."""
    _, cfg, params, _ = tiny("qwen2")
    kw = dict(page_size=4, num_pages=60, max_slots=6, max_pages_per_slot=16, prefill_chunk=32,
              prefill_rows=2, prefill_block_pages=2, decode_block_pages=2)
    batches = ([5, 7], [8, 8, 3], [8, 8, 8, 8, 8], [20, 3])  # 2, 3 rows of S; 5; too long
    wide, wide_shapes = _prefill_calls(cfg, params, EngineConfig(**kw), batches, 3)
    short, short_shapes = _prefill_calls(cfg, params, EngineConfig(prefill_short_chunk=8, **kw),
                                         batches, 3)
    assert wide_shapes == [(2, 32)] * 4
    assert short_shapes == [(1, 8)] * 5 + [(2, 32)] * 2
    _same_pages(wide, short)
    for bad in (3, 32):
        with pytest.raises(ValueError, match="prefill_short_chunk"):
            EngineConfig(prefill_short_chunk=bad, **kw)
    resumed = dict(max_prompt_len=40, max_new_tokens=200, max_slots=4, num_pages=64)
    assert rollout.engine_config(cfg, resumed_prompts=True, **resumed).prefill_short_chunk == 64
    assert rollout.engine_config(cfg, **resumed).prefill_short_chunk == 0


def test_pool_and_prompt_errors(tiny):
    _, cfg, params, _ = tiny("llama")
    prompts = _prompts(cfg, [4, 30])
    with pytest.raises(ValueError, match=r"prompt 1 of 30 tokens \+ 4 new needs 10 pages .*pool"):
        rollout.generate(cfg, params, prompts, max_new_tokens=4, page_size=4, pool_tokens=16)
    with pytest.raises(ValueError, match="prompt 1 has token ids outside"):
        rollout.generate(cfg, params, [[1, 2], [5, cfg.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0 must be a non-empty"):
        rollout.generate(cfg, params, [[]], max_new_tokens=2)


@pytest.mark.slow
def test_top_k_top_p_sharded_params(tiny):
    """Log-probs under the top-k / top-p distribution; params sharded for training (left in
    their sharding) give the same samples as unsharded ones."""
    _, cfg, params, path = tiny("qwen2")
    prompts = _prompts(cfg, [6, 9], seed=4)
    kw = dict(max_new_tokens=4, num_samples=2, temperature=0.7, top_k=20, top_p=0.9, seed=3,
              **SMALL)
    want = rollout.generate(cfg, params, prompts, **kw)
    for samples, rows_g in zip(want, _forward_logits(cfg, params, prompts, want)):
        for (tokens, logps), rows in zip(samples, rows_g):
            ref = [_np_filtered_logp(r, 0.7, 20, 0.9)[t] for r, t in zip(rows, tokens)]
            np.testing.assert_allclose(logps, ref, atol=1e-4)
    mesh = mesh_lib.make_mesh({"fsdp": 4, "tensor": 2})
    cfg_s, params_s = models.load_hf(str(path), mesh=mesh)
    got = rollout.generate(cfg_s, params_s, prompts, mesh=mesh, **kw)
    assert params_s["layers"]["q_proj"]["kernel"].sharding.spec[1] == "fsdp"
    for a, b in zip(want, got):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-4)


def test_decode_layout_one_array_per_layer_without_fsdp(tiny):
    """The decode copy of the weights: a tuple of layers, the compute dtype, the trainer's
    values, and on a mesh only `tensor` sharding (nothing for a decode step to gather)."""
    from lrl.rollout.weights import decode_params
    _, cfg, params, path = tiny("qwen2")
    cfg = cfg.replace(dtype=jax.numpy.bfloat16)
    mesh = mesh_lib.make_mesh({"fsdp": 4, "tensor": 2})
    _, sharded = models.load_hf(str(path), mesh=mesh)
    got = decode_params(cfg, sharded, mesh)
    assert decode_params(cfg, got, mesh) is got          # already in decode layout
    assert isinstance(got["layers"], tuple) and len(got["layers"]) == cfg.n_layers
    specs = [str(x.sharding.spec) for x in jax.tree.leaves(got)]
    assert not any("fsdp" in s for s in specs) and any("tensor" in s for s in specs), specs
    as_bf16 = lambda x: np.asarray(jax.numpy.asarray(x).astype(jax.numpy.bfloat16), np.float32)
    for layer, tree in enumerate(got["layers"]):
        want = {k: v for k, v in params["layers"].items() if k not in ("gate_proj", "up_proj")}
        want = jax.tree.map(lambda a: a[layer], want)
        want["gate_up"] = {"kernel": np.stack([params["layers"]["gate_proj"]["kernel"][layer],
                                               params["layers"]["up_proj"]["kernel"][layer]],
                                              axis=-2)}
        assert jax.tree.structure(tree) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
            assert a.dtype == jax.numpy.bfloat16
            np.testing.assert_array_equal(np.asarray(a, np.float32), as_bf16(b))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_decode_layout_joins_qkv_without_tensor_parallelism(tiny, arch):
    """Off a tensor-parallel mesh the decode copy holds one [D, N + 2K, H] qkv projection
    (q, k, v heads in that order) whose q, k, v equal the training Block's (Qwen2: biases;
    Qwen3: qk-norm; the greedy tests against transformers run this path end to end)."""
    from lrl.models.decoder import Block
    from lrl.rollout.steps import _qkv_fused
    from lrl.rollout.weights import decode_params
    _, cfg, params, path = tiny(arch)
    got = decode_params(cfg, params)
    layer = got["layers"][1]
    assert "q_proj" not in layer and "gate_proj" not in layer
    want = np.concatenate([np.asarray(params["layers"][n]["kernel"][1])
                           for n in ("q_proj", "k_proj", "v_proj")], axis=-2)
    np.testing.assert_array_equal(np.asarray(layer["qkv"]["kernel"]), want)
    x = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))
    pos = jax.numpy.arange(5)[None].repeat(2, 0) + 7
    train_layer = jax.tree.map(lambda a: a[1], params["layers"])
    ref = Block(cfg).apply({"params": train_layer}, x, pos, method=Block.qkv)
    out = Block(cfg).apply({"params": layer}, x, pos, layer["qkv"], method=_qkv_fused)
    for a, b in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kv_per_program", [1, 0])
def test_generate_with_the_gqa_kernel_equals_xla(tiny, kv_per_program):
    """Whole rollouts through our decode kernel (the Pallas interpreter on CPU), one or both
    kv heads per program, give the XLA path's tokens and log-probs."""
    _, cfg, params, _ = tiny("qwen2")
    prompts = _prompts(cfg, [5, 13, 9])
    kw = dict(max_new_tokens=6, num_samples=2, temperature=1.0, seed=4, page_size=4,
              decode_block_pages=2, pallas_k_splits=1)
    want = rollout.generate(cfg, params, prompts, attention_impl="xla", **kw)
    stats = {}
    got = rollout.generate(cfg, params, prompts, attention_impl="pallas_gqa_interpret",
                           pallas_kv_per_program=kv_per_program, stats=stats, **kw)
    assert stats["attention_impl"] == "pallas_gqa_interpret" and not stats["attention_fallback"]
    assert stats["sampling_impl"] == "pallas_interpret"    # the sampler's kernel follows
    for a, b in zip(want, got):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-4)


@pytest.mark.slow
def test_pages_grow_and_preempted_samples_draw_the_same_tokens(tiny):
    """A pool too small for every slot's samples at once: slots get pages as they grow, the
    youngest are preempted when the pool runs short and run again from their start, and each
    sample draws exactly what it draws in a pool that fits all (its keys are per sample and
    step); one engine serves both batches with one decode program."""
    _, cfg, params, _ = tiny("qwen2")
    prompts = _prompts(cfg, [7, 3, 10, 6], seed=2)
    kw = dict(max_new_tokens=24, num_samples=3, temperature=1.0, max_slots=6, seed=3, **SMALL)
    want = rollout.generate(cfg, params, prompts, reserve_pages=True, **kw)
    stats = {}
    got = rollout.generate(cfg, params, prompts, pool_tokens=4 * 34, stats=stats, **kw)
    assert stats["preempted"] > 0 and stats["preempted_tokens"] > 0
    for a, b in zip(want, got):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-5)
    # reserving every sample's pages up front, the same small pool admits fewer at once
    reserved = {}
    rollout.generate(cfg, params, prompts, pool_tokens=4 * 34, stats=reserved,
                     reserve_pages=True, **kw)
    live = lambda st: st["live_slots_at_calls"] / st["decode_calls"]  # noqa: E731
    assert reserved.get("preempted", 0) == 0 and live(reserved) < live(stats)
    # one engine, two batches of other lengths: nothing compiles again
    ecfg = rollout.engine_config(cfg, max_prompt_len=12, max_new_tokens=24, max_slots=6,
                                 num_pages=40, page_size=4, prefill_chunk=8,
                                 prefill_tokens=32, decode_block_pages=2,
                                 prefill_block_pages=2)
    engine = Engine(cfg, ecfg)
    from lrl.rollout import steps
    for lengths in ([7, 3, 10, 6], [12, 2]):
        rollout.generate(cfg, params, _prompts(cfg, lengths, seed=4), engine=engine,
                         max_new_tokens=16, num_samples=2, temperature=1.0, seed=0,
                         steps_per_call=4)
        if lengths[0] == 7:
            n = steps.decode_steps._cache_size()
    assert steps.decode_steps._cache_size() == n and engine.pool.all_free()


@pytest.mark.slow
def test_tail_decode_calls_on_the_live_rows_draw_the_same_tokens(tiny):
    """Once no sample waits, decode calls compute only the live slots' rows (narrower
    programs, `EngineConfig.narrow_widths`): every sample draws what it draws when each call
    computes all slots, and the rows computed are fewer."""
    _, cfg, params, _ = tiny("qwen2")
    prompts = _prompts(cfg, [7, 3, 10, 6, 5], seed=5)
    lengths = {i: n for i, n in enumerate([2, 20, 3, 1, 5, 24, 2, 2, 9, 4])}
    kw = dict(max_new_tokens=24, num_samples=2, temperature=1.0, max_slots=8, seed=2,
              max_new_fn=lengths.get, **SMALL)
    full, narrow = {}, {}
    want = rollout.generate(cfg, params, prompts, narrow_widths=(), stats=full, **kw)
    got = rollout.generate(cfg, params, prompts, narrow_widths=(2, 4), stats=narrow, **kw)
    assert full["narrow_calls"] == 0 and narrow["narrow_calls"] > 0
    for a, b in zip(want, got):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-5)
    assert [len(t) for s in got for t, _ in s] == [lengths[i] for i in range(10)]
    assert narrow["sampled_tokens"] == full["sampled_tokens"]
    assert narrow["computed_rows"] < full["computed_rows"]
    assert narrow["row_occupancy"] > full["row_occupancy"] == full["slot_occupancy"]
    with pytest.raises(ValueError, match="narrow_widths"):
        EngineConfig(max_slots=4, narrow_widths=(4,))


@pytest.mark.slow
def test_overlapped_admission_draws_the_same_tokens(tiny):
    """`overlap_admission`: while samples wait, the next decode call is launched before the
    last is collected, so freed slots are refilled a call later; each sample still draws what
    it draws when every call is collected at once (its keys are per sample and step), in a
    pool small enough to preempt too."""
    _, cfg, params, _ = tiny("qwen2")
    prompts = _prompts(cfg, [7, 3, 10, 6, 5, 9], seed=6)
    kw = dict(max_new_tokens=24, num_samples=3, temperature=1.0, max_slots=4, seed=1,
              **SMALL)
    for pool in (None, 4 * 30):
        at_once, overlapped = {}, {}
        want = rollout.generate(cfg, params, prompts, pool_tokens=pool, stats=at_once, **kw)
        got = rollout.generate(cfg, params, prompts, pool_tokens=pool, stats=overlapped,
                               overlap_admission=True, **kw)
        for a, b in zip(want, got):
            for (ta, la), (tb, lb) in zip(a, b):
                np.testing.assert_array_equal(ta, tb)
                np.testing.assert_allclose(la, lb, atol=1e-5)
        assert overlapped["sampled_tokens"] >= overlapped["new_tokens"] == at_once["new_tokens"]
        # a freed slot idles through the call in flight: as many steps or more
        assert overlapped["decode_steps"] >= at_once["decode_steps"]
        if pool is not None:
            assert overlapped.get("preempted", 0) + at_once.get("preempted", 0) > 0
