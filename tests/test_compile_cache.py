"""A run's second start: compiled programs come from JAX's persistent cache and the update's
micro-batch budget from the one a start with the same settings found (`lrl.compile_cache`);
the budget search never compiles a shape whose logits alone cannot fit."""
import json
import re
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lrl import compile_cache, compiles
from lrl import loop
from lrl.rl import budget as budget_lib
from lrl.rl import update as update_lib
from tests.test_loop import tiny_config

# These tests count what a run loads from its own cache: the suite's shared one stays out.
pytestmark = pytest.mark.own_compile_cache

HIT = "/jax/compilation_cache/cache_hits"


def _count_hits():
    hits = []
    jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e == HIT else None)
    return hits


def _program(x):
    for _ in range(20):
        x = jnp.tanh(x @ x.T) + x
    return x.sum()


def test_a_program_compiled_in_one_start_is_loaded_by_the_next(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "MIN_COMPILE_SECONDS", 0.0)   # keep even tiny ones
    before = jax.config.jax_compilation_cache_dir
    x = jnp.ones((16, 16)) * 0.01
    with compile_cache.enabled(str(tmp_path)) as cache:
        first = float(jax.jit(_program)(x))
        assert cache.hits == 0
    files = os.listdir(tmp_path / "jax")
    assert files, "nothing written to the cache"
    assert jax.config.jax_compilation_cache_dir == before   # the process's setting is back
    jax.clear_caches()   # what a new process starts with: no program in memory
    with compile_cache.enabled(str(tmp_path)) as cache:
        assert float(jax.jit(_program)(x)) == first
        assert cache.hits == 1
    assert sorted(os.listdir(tmp_path / "jax")) == sorted(files)   # read, nothing new
    # Off: nothing read, nothing written.
    jax.clear_caches()
    with compile_cache.enabled(None) as cache:
        jax.jit(_program)(x)
        assert cache.hits == 0 and cache.path is None


def test_the_cache_folder_setting():
    assert compile_cache.folder("", "/runs/a") is None
    assert compile_cache.folder("auto", "/runs/a") == "/runs/.lrl-cache"
    assert compile_cache.folder("auto", "/runs/a/") == "/runs/.lrl-cache"
    assert compile_cache.folder("/c/x", "/runs/a") == "/c/x"
    with pytest.raises(ValueError, match="compile_cache='/dev/null/x'"):
        with compile_cache.enabled("/dev/null/x"):
            pass


def test_budgets_are_kept_by_key(tmp_path):
    k1 = compile_cache.budget_key(model="a", mesh={"fsdp": 8}, device=("gpu", 141 << 30))
    k2 = compile_cache.budget_key(model="a", mesh={"fsdp": 4}, device=("gpu", 141 << 30))
    assert k1 != k2 and k1 == compile_cache.budget_key(
        device=("gpu", 141 << 30), mesh={"fsdp": 8}, model="a")   # order does not matter
    assert compile_cache.load_budget(str(tmp_path), k1) is None
    compile_cache.save_budget(str(tmp_path), k1, {"rows_per_shard": 3})
    compile_cache.save_budget(str(tmp_path), k2, {"rows_per_shard": 5})
    assert compile_cache.load_budget(str(tmp_path), k1) == {"rows_per_shard": 3}
    assert compile_cache.load_budget(str(tmp_path), k2) == {"rows_per_shard": 5}
    assert compile_cache.load_budget(None, k1) is None
    (tmp_path / compile_cache.BUDGETS).write_text("{not json")
    assert compile_cache.load_budget(str(tmp_path), k1) is None   # unreadable: search again


def test_the_search_never_compiles_a_shape_whose_logits_cannot_fit():
    """The issue's case: Qwen2.5's vocabulary, rows of 8K, a line through 1 and 2 rows that
    guesses 34 rows, whose f32 logits (157.7 GiB) XLA's autotuner would try to allocate."""
    vocab, T, GiB = 151936, 8192, 2**30
    floor = budget_lib.logits_floor(vocab)
    assert floor(34, T) == 278528 * vocab * 4 and floor(34, T) / GiB == pytest.approx(157.66, 1e-3)
    assert budget_lib.logits_floor(vocab, seq=2, tensor=2)(34, T) == floor(34, T) // 4
    available = 120 * GiB
    tried = []

    def need(rows, row_len):   # 20 GiB fixed, ~3 GiB a row: the line says 33 rows fit
        tried.append(rows)
        return 20 * GiB + rows * 3 * GiB
    got = budget_lib.resolve(row_len=T, max_tokens=0, longest=T, unit=1, need_bytes=need,
                             available=available, floor_bytes=floor)
    most = max(k for k in range(1, 65) if floor(k, T) <= available)
    assert most == 25 and max(tried) <= most and got.rows_per_shard == most
    assert all(floor(k, T) <= available for k in tried)
    # Without the floor the same search compiles 33 rows (153 GiB of logits) and beyond.
    tried.clear()
    budget_lib.resolve(row_len=T, max_tokens=0, longest=T, unit=1, need_bytes=need,
                       available=available)
    assert 33 in tried and max(tried) > most and floor(33, T) > available


@pytest.mark.slow
def test_the_second_start_loads_programs_and_skips_the_budget_search(tmp_path, monkeypatch):
    """Two runs of one config in two workdirs side by side (one `.lrl-cache`), device memory
    faked so the budget is searched: the second compiles nothing for the search, loads its
    programs from disk and sizes its micro-batches as the first did. Rows of 256 with a
    minibatch's last rows cut to 128: the search's first line runs through one row of each,
    and the step runs the search's compiles, never compiling one again."""
    c = tiny_config(max_tokens_per_micro=0)
    c.rl.row_len = 256
    c.sft.steps = 0
    c.rl.steps = 1
    c.eval.every = 0
    monkeypatch.setattr(budget_lib, "device_memory", lambda device: (64 << 20, 0))
    searched, ahead = [], []   # shapes compiled by the search, and on the build's thread
    need = update_lib.need_bytes
    monkeypatch.setattr(update_lib, "need_bytes", lambda u, p, spec, *a: (
        searched if threading.current_thread() is threading.main_thread() else ahead
    ).append(spec) or need(u, p, spec, *a))
    ran = set()   # the update's micro-batch shapes the steps ran (warm-up included)
    accumulated = update_lib.run_accumulated
    monkeypatch.setattr(update_lib, "run_accumulated", lambda programs, state, mbs, *a: (
        ran.update(mb["tokens"].shape for mb in mbs) or accumulated(programs, state, mbs, *a)))
    shapes = update_lib.compile_shapes
    monkeypatch.setattr(update_lib, "compile_shapes", lambda u, params, mbs, *a: (
        ran.update(mb["tokens"].shape for mb in mbs) or shapes(u, params, mbs, *a)))
    hits = _count_hits()
    written = []
    note = loop.MetricsWriter.note
    monkeypatch.setattr(loop.MetricsWriter, "note",
                        lambda self, text: written.append(text) or note(self, text))
    starts, notes = [], []
    for name in ("a", "b"):
        jax.clear_caches()   # a new process's start: no program in memory
        del searched[:], ahead[:], hits[:]
        ran.clear()
        t, counted = time.perf_counter(), compiles.snapshot()
        out = loop.run(c, str(tmp_path / name))
        starts.append((time.perf_counter() - t, len(searched), len(hits)))
        if name == "a":
            # Each shape compiles once: the search's programs, and those compiled ahead on a
            # thread while the rollout ran, are the ones the steps run.
            distinct = {spec["tokens"].shape for spec in searched + ahead} | ran
            assert compiles.since(counted).get("jit(_accumulate)") == len(distinct), distinct
            assert 128 in {spec["tokens"].shape[1] for spec in searched}
            assert not {spec["tokens"].shape for spec in searched} & {
                spec["tokens"].shape for spec in ahead}
        notes.append([x for x in written if x.startswith("update micro-batch")][-1])
        assert np.isfinite(out["grpo"]["loss"])
    print(f"\nstarts (s, search compiles, programs loaded): {starts}")
    (_, search_a, hits_a), (_, search_b, hits_b) = starts
    assert search_a >= 2 and hits_a == 0
    assert search_b == 0 and hits_b > 0
    assert "derived from device memory" in notes[0]
    searched_note = re.fullmatch(r"(.*) \(sizing the pool and it compiled (\d+) programs, "
                                 r"\d+ s\)", notes[0])
    assert searched_note and int(searched_note[2]) >= search_a
    assert notes[1] == (searched_note[1]
                        + " (found by an earlier start, kept in the compile cache)")
    budgets = json.loads((tmp_path / ".lrl-cache" / compile_cache.BUDGETS).read_text())
    assert len(budgets) == 1


def test_a_step_out_of_memory_names_the_numbers_and_the_settings():
    from lrl import config_util, options, step_setup
    c = config_util.load(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                      "default.py"))
    opts = options.from_config(c, check_files=False)
    s = step_setup.Setup(rl=opts.rl, rollout=opts.rollout, seed=0, task=None, tokenizer=None,
                         model_cfg=None, mesh=None, eos_ids=(), pool=None, update=None,
                         logprobs=None, shards=1, row_len=8192, rows_per_shard=12,
                         max_segments=8)
    e = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                   "allocate 12.50GiB.\nBuffer assignment: ...")
    msg = loop.out_of_memory_message(opts, s, 7, e)
    assert msg.startswith("GRPO step 7 ran out of device memory (RESOURCE_EXHAUSTED: Out of "
                          "memory while trying to allocate 12.50GiB.)")
    for part in ("12 x 8192 tokens", "rl.max_tokens_per_micro=4096", "rollout.pool_fraction=0.4",
                 "model.remat='full'"):
        assert part in msg, part
    host = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of host memory while trying "
                                      "to allocate 7.00GiB with allocator xla_gpu_host_bfc")
    msg = loop.out_of_memory_message(opts, s, 7, host)
    assert msg.startswith("GRPO step 7 ran out of host memory (RESOURCE_EXHAUSTED: Out of host "
                          "memory while trying to allocate 7.00GiB")
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in msg and "optim.offload='off' (now 'auto')" in msg
    assert "rl.max_tokens_per_micro" not in msg
