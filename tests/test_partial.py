"""Partial rollouts (`rollout.partial`): a step's rollout stops on its budget and the unfinished
samples carry on in the next step, from their KV pages kept in the engine's pool or re-prefilled.
Greedy partial rollouts over several steps with unchanged weights give the tokens of one
uninterrupted rollout either way (and with a pool too small to keep them all); kept pages are
released when their group is dropped and nothing leaks; a carried sample's tokens,
log-probs and versions are those of the policy that drew each; the staleness cap drops and
counts; the loop runs with it on and compiles nothing new after its second step; a resume after
SIGTERM continues the carried samples the checkpoint saved and logs what the uninterrupted run
logs."""
import dataclasses
import json
import os
import signal
import types

import jax
import numpy as np
import pytest

from lrl import collect, collect_partial, compiles, config_util, loop, models, options, rollout, step_setup
from lrl.rollout import partial
from lrl.tasks import Prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = models.ModelConfig(model_type="qwen2", vocab_size=64, d_model=32, n_layers=2,
                          n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, remat="none")
MAX_NEW = 40   # more than a decode call's 16 steps: a budget can stop a sample mid-way


def _setup(max_slots=4, partial_tokens=50, max_staleness=2, prompts_per_step=3,
           partial_tail=0.0, partial_seconds=0.0):
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.rl.update(max_new_tokens=MAX_NEW, temperature=0.0, group_size=2,
                prompts_per_step=prompts_per_step)
    c.rollout.update(partial=True, partial_tokens=partial_tokens, max_staleness=max_staleness)
    rl = options.from_config(c).rl
    ro = options.RolloutOptions(page_size=4, max_slots=max_slots, pool_tokens=0,
                                pool_fraction=0.4, prefill_tokens=256, sp_min_tokens=0,
                                narrow_decode=True, overlap_admission=True, partial=True,
                                partial_tokens=partial_tokens, partial_backlog=0.0,
                                partial_tail=partial_tail, partial_seconds=partial_seconds,
                                max_staleness=max_staleness,
                                partial_keep_kv=True)
    return step_setup.Setup(rl=rl, rollout=ro, seed=0, task=None, tokenizer=None, model_cfg=TINY,
                         mesh=None, eos_ids=(), pool=None, update=None, logprobs=None, shards=1,
                         row_len=64, rows_per_shard=1, max_segments=8)


def _params(seed, scale=3.0):
    return jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x,
                        models.init_params(TINY, jax.random.key(seed)))


def _prompts(lengths=(5, 9, 7), seed=0):
    rng = np.random.RandomState(seed)
    return [Prompt(rng.randint(1, 64, n).astype(np.int32), str(i), {}, "")
            for i, n in enumerate(lengths)]


def test_greedy_partial_rollout_over_steps_equals_one_uninterrupted_rollout():
    s = _setup()
    params = _params(1)
    prompts = _prompts()
    want = collect.rollout_groups(s, params, prompts, group_size=2, seed=0)
    carry, trained, steps, spans = (), {}, 0, []
    new = prompts
    while len(trained) < len(prompts):
        groups, carry, m = collect_partial.partial_rollout(s, params, carry, new, steps, seed=steps)
        new, steps = [], steps + 1
        if steps == 1:   # the budget stopped the first step with samples half done, some unbegun
            assert m["partial/trained_groups"] == 0 and m["partial/carried_samples"] == 6
            begun = [x.tokens.size for g in carry for x in g.samples]
            # the budget is spent once the first call (16 steps) is collected; with
            # overlap_admission the second was launched before that, and runs too
            assert 0 in begun and max(begun) == 16 * (1 + s.rollout.overlap_admission)
        for g in range(groups.P):
            trained[groups.prompts[g].answer] = groups.completions[2 * g:2 * g + 2]
        spans.append(m["partial/version_span_max"])
        assert steps < 10
    assert steps >= 3 and max(spans) >= 1 and m["partial/dropped_stale_groups"] == 0
    for p, prompt in enumerate(prompts):
        for g in range(2):
            np.testing.assert_array_equal(trained[prompt.answer][g], want.completions[2 * p + g])


def _with_engine(s, num_pages=256):
    """The setup with a run's engine (one that outlives a rollout, so carried samples can keep
    their pages in its pool)."""
    ecfg = rollout.engine_config(TINY, max_prompt_len=16, max_new_tokens=MAX_NEW,
                                 max_slots=s.rollout.max_slots, num_pages=num_pages,
                                 page_size=s.rollout.page_size)
    return dataclasses.replace(s, engine=rollout.Engine(TINY, ecfg))


def _run_steps(s, params, prompts):
    """Partial steps until every group trained: -> (completions by prompt, each step's
    metrics)."""
    carry, trained, rows, new = (), {}, [], prompts
    while len(trained) < len(prompts):
        groups, carry, m = collect_partial.partial_rollout(s, params, carry, new, len(rows),
                                                   seed=len(rows), stats=(st := {}))
        new = []
        rows.append({**m, **{f"rollout/{k}": v for k, v in st.items() if np.isscalar(v)}})
        for g in range(groups.P):
            trained[groups.prompts[g].answer] = groups.completions[2 * g:2 * g + 2]
        assert len(rows) < 10
    return trained, rows


def _assert_same(trained, want, prompts):
    for p, prompt in enumerate(prompts):
        for g in range(2):
            np.testing.assert_array_equal(trained[prompt.answer][g], want.completions[2 * p + g])


@pytest.mark.optimized
def test_greedy_partial_rollout_with_kept_pages_equals_one_uninterrupted_rollout():
    """Carried samples resume from their KV pages kept in the engine's pool, with no prefill;
    with unchanged weights the tokens are those of one uninterrupted rollout, and once every
    group trained the pool is all free again."""
    s = _with_engine(_setup())
    params, prompts = _params(1), _prompts()
    want = collect.rollout_groups(s, params, prompts, group_size=2, seed=0)
    trained, rows = _run_steps(s, params, prompts)
    assert len(rows) >= 3 and rows[0]["partial/carried_samples"] == 6
    assert sum(r["partial/kept_samples"] for r in rows) >= 4
    assert all(r["partial/reprefill_tokens"] == 0 for r in rows)
    assert all(r["rollout/kept_released"] == 0 for r in rows if "rollout/kept_released" in r)
    _assert_same(trained, want, prompts)
    assert s.engine.pool.all_free() and not s.engine.kept
    # Off, the same run prefills its carried samples again, to the same tokens.
    off = dataclasses.replace(s, rollout=dataclasses.replace(s.rollout, partial_keep_kv=False))
    trained, rows = _run_steps(off, params, prompts)
    assert sum(r["partial/kept_samples"] for r in rows) == 0
    assert sum(r["partial/reprefill_tokens"] for r in rows) > 0
    _assert_same(trained, want, prompts)


@pytest.mark.slow
def test_a_pool_too_small_to_keep_every_carried_sample_prefills_some_to_the_same_tokens():
    """Kept pages go (those samples prefilled again) before a live sample is preempted or
    admission waits; the tokens are still those of one uninterrupted rollout."""
    s = _with_engine(_setup(), num_pages=40)
    params, prompts = _params(1), _prompts()
    want = collect.rollout_groups(_setup(), params, prompts, group_size=2, seed=0)
    trained, rows = _run_steps(s, params, prompts)
    assert sum(r.get("rollout/kept_released", 0) for r in rows) > 0, rows
    assert sum(r["partial/kept_samples"] for r in rows) > 0
    assert sum(r["partial/reprefill_tokens"] for r in rows) > 0
    _assert_same(trained, want, prompts)
    assert s.engine.pool.all_free() and not s.engine.kept


def test_kept_pages_of_a_group_dropped_as_stale_are_released():
    s = _with_engine(_setup(max_slots=8, partial_tokens=1, max_staleness=2, prompts_per_step=2))
    params = _params(1)
    _, carry, m = collect_partial.partial_rollout(s, params, (), _prompts((6, 8)), 0, seed=0)
    assert m["partial/carried_samples"] == 4 and len(s.engine.kept) == 4
    assert all(s.engine.holds(x.kept) for g in carry for x in g.samples)
    assert not s.engine.pool.all_free()
    _, kept, m = collect_partial.partial_rollout(s, params, carry, [], 3, seed=3)
    assert m["partial/dropped_stale_groups"] == 2 and kept == ()
    assert s.engine.pool.all_free() and not s.engine.kept
    s.engine.keep_state(s.engine.take_state())   # the invariant holds: nothing leaked


def test_a_partial_rollout_stops_in_its_tail_and_the_next_step_finishes_it():
    """`rollout.partial_tail`: once no sample waits and fewer than that share of the slots are
    live, the step stops; what ran on is carried, and finishing it later gives the tokens of
    one uninterrupted rollout (greedy, unchanged weights)."""
    s = _setup(max_slots=8, partial_tokens=0, prompts_per_step=3, partial_tail=0.5)
    # the first sample of each group ends after 3 tokens, the second runs to MAX_NEW: after
    # the first decode call 3 of 6 slots are live, fewer than half of the 8
    s = dataclasses.replace(s, max_new_fn=lambda key: 3 if key[1] == 0 else MAX_NEW)
    params, prompts = _params(1), _prompts()
    want = collect.rollout_groups(s, params, prompts, group_size=2, seed=0)
    groups, carry, m = collect_partial.partial_rollout(s, params, (), prompts, 0, seed=0, stats=(st := {}))
    assert st["stopped_in_tail"] == 1 and groups.P == 0
    assert m["partial/carried_samples"] == 3
    assert all(0 < x.tokens.size < MAX_NEW for g in carry for x in g.samples if not x.done)
    trained, step = {}, 1
    while len(trained) < len(prompts):
        groups, carry, m = collect_partial.partial_rollout(s, params, carry, [], step, seed=step)
        for g in range(groups.P):
            trained[groups.prompts[g].answer] = groups.completions[2 * g:2 * g + 2]
        step += 1
        assert step < 10
    for p, prompt in enumerate(prompts):
        assert [len(c) for c in trained[prompt.answer]] == [3, MAX_NEW]
        for g in range(2):
            np.testing.assert_array_equal(trained[prompt.answer][g], want.completions[2 * p + g])


def test_carried_tokens_keep_the_log_probs_and_versions_of_the_policy_that_drew_them():
    s = _setup(max_slots=8, partial_tokens=1, prompts_per_step=2)
    a, b = _params(1), _params(2)
    prompts = _prompts((6, 8))
    groups, carry, m = collect_partial.partial_rollout(s, a, (), prompts, 0, seed=0)
    assert groups.P == 0 and m["partial/carried_samples"] == 4
    ref_a = rollout.generate(TINY, a, [p.ids for p in prompts], max_new_tokens=MAX_NEW,
                             num_samples=2, page_size=4)
    for p, grp in enumerate(carry):
        for g, x in enumerate(grp.samples):
            k = x.tokens.size
            # A call's 16 steps, or two: once no sample waits, the next call is launched
            # before the last is collected, so the budget ends a call late.
            assert 0 < k < MAX_NEW and not x.done and (x.versions == 0).all()
            np.testing.assert_array_equal(x.tokens, ref_a[p][g][0][:k])
            np.testing.assert_allclose(x.logps, ref_a[p][g][1][:k], atol=1e-5)
    first = carry
    s = dataclasses.replace(s, rollout=dataclasses.replace(s.rollout, partial_tokens=0))
    groups, carry, m = collect_partial.partial_rollout(s, b, first, [], 1, seed=1)
    assert groups.P == 2 and carry == () and m["partial/version_span_mean"] == 1.0
    assert groups.sample_ages().tolist() == [1, 1, 1, 1] and m["partial/age_max"] == 1
    for p, grp in enumerate(first):
        for g, x in enumerate(grp.samples):
            k = x.tokens.size
            (tok_b, lp_b), = rollout.generate(
                TINY, b, [np.concatenate([prompts[p].ids, x.tokens])],
                max_new_tokens=MAX_NEW - k, num_samples=1, page_size=4)[0]
            got, logp = groups.completions[2 * p + g], groups.logps[2 * p + g]
            np.testing.assert_array_equal(got, np.concatenate([x.tokens, tok_b]))
            np.testing.assert_allclose(logp[:k], x.logps)        # drawn by a, version 0
            np.testing.assert_allclose(logp[k:], lp_b, atol=1e-5)  # drawn by b, version 1


def test_the_staleness_cap_drops_and_counts_whole_groups():
    def group(versions_per_sample, done=False):
        return partial.Pending(None, tuple(
            partial.Sample(np.zeros(len(v), np.int32), np.zeros(len(v), np.float32),
                           np.asarray(v, np.int32), done) for v in versions_per_sample))
    old = group([[0, 1], [1]])          # oldest token drawn at version 0
    young = group([[2, 3], []])         # oldest at 2; one sample not begun
    fresh = group([[], []])
    kept, groups, samples = partial.drop_stale((old, young, fresh), 3, 2)
    assert kept == (young, fresh) and (groups, samples) == (1, 2)
    kept, groups, samples = partial.drop_stale((old, young, fresh), 4, 2)
    assert len(kept) == 2 and kept[0] is young and (groups, samples) == (1, 2)
    kept, groups, samples = partial.drop_stale((old, young, fresh), 5, 2)
    assert kept == (fresh,) and (groups, samples) == (2, 4)
    # Through a step: what the first step carries is 3 versions old at step 3, cap 2.
    s = _setup(max_slots=8, partial_tokens=1, max_staleness=2, prompts_per_step=2)
    params = _params(1)
    _, carry, m0 = collect_partial.partial_rollout(s, params, (), _prompts((6, 8)), 0, seed=0)
    assert m0["partial/carried_age_max"] == 0 and m0["partial/carried_samples"] == 4
    groups, _, m = collect_partial.partial_rollout(s, params, carry, [], 2, seed=2)
    assert m["partial/dropped_stale_groups"] == 0 and groups.sample_ages().tolist() == [2] * 4
    _, kept, m = collect_partial.partial_rollout(s, params, carry, [], 3, seed=3)
    assert m["partial/dropped_stale_groups"] == 2 and m["partial/dropped_stale_samples"] == 4
    assert kept == () and m["partial/carried_samples"] == 0


def test_a_time_budget_stops_the_rollout_and_the_next_step_goes_on():
    """`rollout.partial_seconds`: a budget spent at once stops the step after its first
    collected decode call; what ran is carried, and the samples still finish later with the
    tokens of one uninterrupted rollout (greedy, unchanged weights)."""
    s = _setup(max_slots=8, partial_tokens=0, prompts_per_step=3, partial_seconds=1e-9)
    params, prompts = _params(1), _prompts()
    want = collect.rollout_groups(s, params, prompts, group_size=2, seed=0)
    groups, carry, m = collect_partial.partial_rollout(s, params, (), prompts, 0, seed=0)
    assert groups.P == 0 and m["partial/carried_samples"] == 6
    assert all(0 < x.tokens.size < MAX_NEW for g in carry for x in g.samples)
    s = dataclasses.replace(s, rollout=dataclasses.replace(s.rollout, partial_seconds=0.0))
    groups, carry, m = collect_partial.partial_rollout(s, params, carry, [], 1, seed=1)
    assert groups.P == 3 and not carry
    np.testing.assert_array_equal(np.concatenate(groups.completions),
                                  np.concatenate(want.completions))


def test_partial_options_are_checked():
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.rollout.partial_tokens = 100
    with pytest.raises(ValueError, match="rollout.partial_tokens=100.*rollout.partial=True"):
        options.from_config(c, check_files=False)
    c.rollout.partial_tokens = 0
    c.rollout.partial_seconds = 2.5
    with pytest.raises(ValueError, match="rollout.partial_seconds=2.5.*rollout.partial=True"):
        options.from_config(c, check_files=False)
    c.rollout.partial_seconds = 0.0
    # The tail share: -1 (the default) is, with partial rollouts, an eighth of the step's
    # samples as a share of the slots, at most half of them, and 0 without, so
    # `rollout.partial=True` alone stops in the tail; set without partial it is refused.
    assert options.from_config(c, check_files=False).rollout.partial_tail == 0.0
    c.rollout.partial_tail = 0.3
    with pytest.raises(ValueError, match="rollout.partial_tail=0.3.*rollout.partial=True"):
        options.from_config(c, check_files=False)
    c.rollout.partial_tail = -0.5
    with pytest.raises(ValueError, match="rollout.partial_tail=-0.5: a share"):
        options.from_config(c, check_files=False)
    c.rollout.partial_tail = -1.0
    c.rollout.partial = True
    ro = options.from_config(c, check_files=False).rollout   # 4 x 4 samples in 16 slots
    assert (ro.max_slots, ro.partial_tail) == (16, 0.125)
    for slots, share in ((8, 0.25), (4, 0.5), (2, 0.5)):   # 2 live of 16 samples, or half
        c.rollout.max_slots = slots
        assert options.from_config(c, check_files=False).rollout.partial_tail == share
    c.rollout.max_slots = 0
    c.rollout.partial_tail = 0.0   # stop on finished groups (and budgets) only
    assert options.from_config(c, check_files=False).rollout.partial_tail == 0.0
    # Dynamic sampling and reinforce_pp run with partial rollouts.
    c.rl.update(dynamic_sampling=True, estimator="reinforce_pp")
    options.from_config(c, check_files=False)
    c.rollout.max_staleness = -1
    with pytest.raises(ValueError, match="rollout.max_staleness=-1"):
        options.from_config(c, check_files=False)
    # The video task stays refused: its prompts' embeddings are not kept across steps.
    v = config_util.load(os.path.join(ROOT, "configs", "video_synthetic.py"), "runlocal")
    v.rollout.partial = True
    with pytest.raises(ValueError, match="text task only.*embeddings are not kept"):
        options.from_config(v, check_files=False)


def _loop_config(steps, first_long=0):
    """-> (a tiny partial-rollout config, the phase's build with its samples' lengths forced:
    `loop.run(c, workdir, build=build)`)."""
    from lrl import build as build_lib
    from tests.test_loop import tiny_config
    c = tiny_config()
    c.rl.max_new_tokens = 48
    c.data.max_prompt_len = 80   # a sample fits one packed row of 128
    c.sft.steps = 0
    c.rl.steps = steps
    c.eval.every = 0
    c.reward.spec = "test_digits:1.0"
    # the token budget alone stops a step (not the default tail share)
    c.rollout.update(partial=True, partial_tokens=32, max_staleness=2, partial_tail=0.0)
    rng = np.random.default_rng(0)
    drawn = []

    def length(sample_id):
        # The first `first_long` samples run to 48 tokens: with 8, the budget stops the whole
        # first step, which trains nothing.
        drawn.append(None)
        return 48 if len(drawn) <= first_long else int(rng.integers(1, 49))

    def with_varied_lengths(*args):
        # A random policy never ends by itself: each decode run of a sample ends after 1..48
        # tokens (two decode calls, the budget's, take 32 at most: the rest is carried).
        s, live = build_lib.grpo(*args)
        return dataclasses.replace(s, max_new_fn=length), live

    return c, with_varied_lengths


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_loop_runs_with_partial_rollouts_and_compiles_nothing_after_step_two(
        tmp_path, monkeypatch):
    c, build = _loop_config(steps=6)
    before = compiles.snapshot()
    loop.run(c, str(tmp_path), build=build)
    steps = [r for r in _rows(tmp_path) if "compiles/step" in r]
    assert len(steps) == 6
    assert sum(r["partial/carried_samples"] for r in steps) > 0
    assert sum("rollout/occupancy" in r for r in steps) >= 4
    assert max(r["partial/version_span_max"] for r in steps) >= 1
    trained = [r for r in steps if r["partial/trained_groups"]]
    assert len(trained) >= 4 and all(np.isfinite(r["loss"]) for r in trained)
    for r in steps:
        assert all(np.isfinite(v) for k, v in r.items() if k.startswith("partial/")
                   or k.endswith("occupancy")), r
        # a step whose carried groups alone are complete decodes nothing (no rollout/ keys)
        if "rollout/occupancy" in r:
            assert 0 < r["rollout/occupancy"] <= r["rollout/slot_occupancy"] <= 1
    # the carried samples resume from their kept pages (the pool holds them all)
    assert sum(r["partial/kept_samples"] for r in steps) > 0
    assert sum(r["partial/reprefill_tokens"] for r in steps) == 0
    assert [r["compiles/step"] for r in steps[2:]] == [0] * 4, [r["compiles/step"] for r in steps]
    # one decode program: the 128 slots' tail width (32 rows) holds every call of this run
    decode = {k: v for k, v in compiles.since(before).items() if k.startswith("jit(decode_")}
    assert decode and all(v == 1 for v in decode.values()), decode


def _run_cut(workdir, c, build, monkeypatch, at):
    """Runs `c` in `workdir`, SIGTERMed once step `at` is logged (the handler only sets a
    flag: the loop saves that step and stops), then resumed to the end. -> the rows the cut
    run logged before the resume."""
    from lrl import metrics as metrics_lib
    write = metrics_lib.MetricsWriter.write

    def write_then_sigterm(self, step, metrics, phase="grpo"):
        scalars = write(self, step, metrics, phase)
        if step == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return scalars

    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_then_sigterm)
    loop.run(c, str(workdir), build=build)
    cut = _rows(workdir)
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write)
    loop.run(c, str(workdir), build=build)
    return cut


def _compared(row):
    # Wall times and compile counts and seconds differ between runs (a resumed run compiles
    # again, or loads from the compile cache, on its own first step), and so does the engine's running count of pages
    # allocated since it was built (per process).
    return {k: v for k, v in row.items()
            if not k.startswith(("time/", "compiles/", "compile_cache/", "compile_s/",
                                "setup_compile_s/"))
            and not k.endswith("_s") and k != "rollout/pages_allocated"}


def _assert_rows_match(got, want, kept=_compared):
    for a, b in zip(got, want):
        a, b = kept(a), kept(b)
        assert sorted(a) == sorted(b)
        for k in a:
            if isinstance(a[k], str):
                assert a[k] == b[k], k
            else:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
@pytest.mark.optimized
def test_resume_after_sigterm_with_carried_samples_equals_the_uninterrupted_run(
        tmp_path, monkeypatch):
    """The checkpoint saves the carried groups: the resumed run continues the same samples and
    logs what the uninterrupted run logs. Its first step trains nothing (every group still
    running), covering a partial step without an update through the loop and its console.
    No KV is saved: the resumed run prefills its carried samples again, so both runs do
    (kept pages would give the uninterrupted run's sampler slightly other log-probs)."""
    c, build = _loop_config(steps=5, first_long=8)
    c.rollout.partial_keep_kv = False
    # one batch a step: the first step's 8 samples are all long (with a backlog, the second
    # batch's short ones would finish groups in it)
    c.rollout.partial_backlog = 0.0
    loop.run(c, str(tmp_path / "straight"), build=build)
    want = _rows(tmp_path / "straight")
    restore = loop._restore_carry
    resumed = []
    monkeypatch.setattr(loop, "_restore_carry",
                        lambda *a: resumed.append(restore(*a)) or resumed[-1])
    c, build = _loop_config(steps=5, first_long=8)   # the same lengths drawn again
    c.rollout.partial_keep_kv = False
    c.rollout.partial_backlog = 0.0
    first, second, third = _run_cut(tmp_path / "cut", c, build, monkeypatch, at=3)
    assert first["partial/trained_groups"] == 0 and "loss" not in first
    assert first["partial/carried_samples"] > 0    # (a sample may draw the end token)
    assert second["partial/trained_groups"] > 0 and np.isfinite(second["loss"])
    assert third["partial/carried_samples"] > 0
    # The resume really had carried samples to continue: those the cut run's step 3 carried.
    (carry, dropped), = [x for x in resumed if x != (None, 0)]
    assert dropped == 0 and len(carry) == third["partial/carried_groups"] \
        + third["partial/carried_complete_groups"]
    assert sum(not x.done for g in carry for x in g.samples) == third["partial/carried_samples"]
    got = _rows(tmp_path / "cut")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert all("partial/dropped_on_resume" not in r for r in got)
    assert all(np.isfinite(r["loss"]) for r in got[3:])
    assert got[3]["partial/reprefill_tokens"] > 0 and got[3]["partial/kept_samples"] == 0
    _assert_rows_match(got, want)


@pytest.mark.slow
def test_a_checkpoint_without_carried_groups_drops_its_carried_samples_and_counts_them(
        tmp_path, monkeypatch):
    """A checkpoint from before the carried groups were saved (only their counts): the
    resumed run drops them, says how many, and runs on."""
    real = loop._carried
    monkeypatch.setattr(loop, "_carried",
                        lambda carry: {k: v for k, v in real(carry).items() if k != "carried"})
    c, build = _loop_config(steps=4, first_long=8)
    *_, third = _run_cut(tmp_path, c, build, monkeypatch, at=3)
    carried = third["partial/carried_samples"]
    assert carried > 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["partial/dropped_on_resume"] == carried and np.isfinite(rows[3]["loss"])


def test_carried_groups_round_trip_through_the_data_state_and_refuse_what_would_not():
    from lrl import checkpoint_items as ci
    from lrl import tasks
    p = Prompt(np.array([3, 4, 5], np.int32), "12", {"task": "arithmetic", "n": 2}, "1+11=")
    done = partial.Sample(np.array([7, 8], np.int32), np.array([-0.1, -1e-7], np.float32),
                          np.array([0, 1], np.int32), True)
    groups = (partial.Pending(p, (done, partial.Sample())),)
    # As the checkpoint writes and reads it: JSON, bytes as base64.
    saved = json.loads(json.dumps(ci.encode_data(
        partial.to_state(groups, tasks.prompt_to_state))))
    (g,) = partial.from_state(ci.decode_data(saved), tasks.prompt_from_state)
    assert (g.prompt.answer, g.prompt.meta, g.prompt.text) == ("12", p.meta, "1+11=")
    np.testing.assert_array_equal(g.prompt.ids, p.ids)
    for a, b in zip(g.samples, groups[0].samples):
        assert a.done == b.done and a.logps.dtype == np.float32
        for f in ("tokens", "logps", "versions"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    with pytest.raises(ValueError, match="embeds"):
        tasks.prompt_to_state(dataclasses.replace(p, embeds=np.zeros((3, 2))))
    with pytest.raises(ValueError, match="would not come back the same"):
        tasks.prompt_to_state(dataclasses.replace(p, meta={"span": (1, 2)}))
    with pytest.raises(ValueError, match="not JSON"):
        tasks.prompt_to_state(dataclasses.replace(p, meta={"n": np.int64(2)}))
    saved[0]["samples"][0]["versions"] = [0]
    with pytest.raises(ValueError, match="carried group 0.*lengths"):
        partial.from_state(ci.decode_data(saved), tasks.prompt_from_state)
    # The loop names the file the malformed groups came from.
    with pytest.raises(ci.CheckpointError, match="/ckpt/3/data .*carried group 0"):
        loop._restore_carry(types.SimpleNamespace(rollout_mesh=None),
                                {"carried": ci.decode_data(saved)}, "/ckpt/3")
