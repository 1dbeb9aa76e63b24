"""Multi-turn rollouts in the scheduler (`lrl.rollout.turns`) against a reference loop that
re-prefills each sample's whole history every turn: the same greedy tokens, log-probs within
fp32 tolerance, exact model masks; with waits that let other samples decode and be admitted,
a per-turn cap, a pool so small that waiting samples' pages are released and prefilled
again, a stop while samples wait on their tools, and observations checked against the room.
The tools are scripted (`Script`): no threads, answers due a set number of polls later."""
import jax
import numpy as np
import pytest

import lrl.models as models
import lrl.rollout as rollout
from lrl import compiles
from lrl.rollout import scheduler, steps

CFG = models.ModelConfig(model_type="qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=8, mlp_dim=64, remat="none")
EOS, TURN_END = (7,), (42,)   # both frequent in this model's greedy outputs
LIMIT = 40                    # tokens of a whole trajectory, observations included
SIZES = dict(page_size=4, prefill_chunk=16, steps_per_call=4)


class Script:
    """Fake tools: after model turn t of sample (p, g) the observation is `obs(p, g, t)`
    (cut to the room), due `delay(p, g, t)` polls later; the trajectory ends after `turns`
    model turns. Records every `turn_ended` call."""

    def __init__(self, turns=3, delay=lambda p, g, t: (p + g + t) % 3):
        self.turns, self.delay = turns, delay
        self.calls, self.due, self.polls = [], [], 0

    @staticmethod
    def obs(p, g, t):
        return np.asarray([(5 * p + 3 * g + t) % 60 + 1 for _ in range(1 + (p + t) % 4)]) \
            + np.arange(1 + (p + t) % 4)

    def answer(self, key, t, room):
        return None if t >= self.turns else self.obs(*key, t)[:room]

    def turn_ended(self, key, tokens, room, cut):
        t = sum(c[0] == key for c in self.calls) + 1
        self.calls.append((key, tokens.tolist(), room, cut))
        self.due.append((self.polls + self.delay(*key, t), key, self.answer(key, t, room)))

    def ready(self, block):
        self.polls += 1
        if block and self.due:
            self.polls = max(self.polls, min(d for d, _, _ in self.due))
        out = [(k, o) for d, k, o in self.due if d <= self.polls]
        self.due = [x for x in self.due if x[0] > self.polls]
        return out


@pytest.fixture(scope="module")
def setup():
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x,
                          models.init_params(CFG, jax.random.key(0)))
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, 64, n).astype(np.int32) for n in (7, 3, 10, 6, 5)]
    # One engine for every reference call: its shapes fixed, so each compiles once.
    ref = rollout.engine_for(CFG, rollout.Request([np.ones(LIMIT + 10, np.int32)], LIMIT,
                                                  eos_ids=EOS + TURN_END),
                             max_slots=1, **_engine_sizes())
    return params, prompts, ref


def _engine_sizes():
    return {k: v for k, v in SIZES.items() if k != "steps_per_call"}


def reference(params, engine, prompt, key, script, cap=0):
    """Sample `key`'s trajectory turn by turn, each turn a fresh greedy rollout of its whole
    history so far (prompt, turns, observations). -> (tokens, logps, mask, end, calls)."""
    tokens, logps, mask, calls, t = [], [], [], [], 0
    while True:
        room = LIMIT - len(tokens)
        n = min(room, cap) if cap else room
        res = scheduler.run(engine, params, rollout.Request(
            [np.concatenate([prompt, np.asarray(tokens, np.int32)])], n, eos_ids=EOS + TURN_END),
            policy=rollout.Policy(steps_per_call=4))
        turn, lp = res.samples[0][0]
        tokens += turn.tolist()
        logps += lp.tolist()
        mask += [1] * len(turn)
        if len(tokens) >= LIMIT:
            return tokens, logps, mask, "length", calls
        t += 1
        room = LIMIT - len(tokens)
        calls.append((key, list(tokens), room, int(turn[-1]) not in EOS + TURN_END))
        obs = script.answer(key, t, room)
        if obs is None:
            return tokens, logps, mask, "done", calls
        tokens += obs.tolist()
        logps += [0.0] * len(obs)
        mask += [0] * len(obs)
        if len(tokens) >= LIMIT:
            return tokens, logps, mask, "length", calls


def _run(params, prompts, script, *, slots=3, pool_tokens=None, G=2, cap=0,
         extend_block_pages=0, **kw):
    request = rollout.Request(prompts, LIMIT, G, eos_ids=EOS, turns=script,
                              turn_end_ids=TURN_END, max_turn_tokens=cap, **kw)
    engine = rollout.engine_for(CFG, request, max_slots=slots, pool_tokens=pool_tokens,
                                extend_block_pages=extend_block_pages, **_engine_sizes())
    stats = {}
    result = scheduler.run(engine, params, request, stats=stats,
                           policy=rollout.Policy(steps_per_call=SIZES["steps_per_call"]))
    return result, stats, engine


def _check_against_reference(params, prompts, ref, result, script, G, cap=0):
    calls = []
    for p, prompt in enumerate(prompts):
        for g in range(G):
            tokens, logps, mask, end, c = reference(params, ref, prompt, (p, g),
                                                    Script(script.turns), cap)
            got, got_lp = result.samples[p][g]
            assert got.tolist() == tokens, (p, g)
            np.testing.assert_allclose(got_lp, logps, atol=2e-5, rtol=1e-5)
            assert result.model_masks[p][g].tolist() == mask, (p, g)
            assert result.ends[p][g] == end, (p, g)
            calls += c
    # The tools saw what the reference's did: every turn's tokens, room and cut.
    assert sorted(script.calls) == sorted(calls)
    return calls


def test_greedy_multi_turn_equals_a_loop_that_prefills_the_whole_history(setup):
    params, prompts, ref = setup
    script = Script(turns=3)
    # Pages for every trajectory at once: `Policy.turn_order` starts each as soon as a slot
    # frees, so more are under way than there are slots (a smaller pool: the test below).
    room = len(prompts) * 2 * (max(map(len, prompts)) + LIMIT + 8)
    result, stats, engine = _run(params, prompts, script, slots=3, pool_tokens=room)
    calls = _check_against_reference(params, prompts, ref, result, script, G=2)
    assert stats["turns"] == len(calls) and stats["turns"] > 2 * len(prompts)
    assert stats["observed_tokens"] == sum(
        int((m == 0).sum()) for per in result.model_masks for m in per)
    assert any(e == "done" for per in result.ends for e in per)
    # Slots waited while others decoded and new samples came in.
    assert stats["steps_while_waiting"] > 0 and stats["occupancy_waiting"] > 0
    assert stats.get("refilled", 0) == 0 and stats.get("waiting_released", 0) == 0
    assert engine.pool.all_free() and all(s is None for s in engine.slot_pages)


def test_observations_read_the_history_in_small_blocks_as_in_one(setup, monkeypatch):
    # `extend_block_pages` of 2 (8 tokens): every observation's call reads its history over
    # several blocks of the paged loop, where the default's one block holds it all.
    params, prompts, ref = setup
    blocks, real = [], steps.pa.paged_attention_xla

    def spy(*args):
        blocks.append(args[-1])     # pages_per_block, seen as each program traces
        return real(*args)
    monkeypatch.setattr(steps.pa, "paged_attention_xla", spy)
    script = Script(turns=3)
    room = len(prompts) * 2 * (max(map(len, prompts)) + LIMIT + 8)
    result, stats, engine = _run(params, prompts, script, slots=3, pool_tokens=room,
                                 extend_block_pages=2)
    assert engine.ecfg.extend_pages_per_block == 2 < engine.ecfg.prefill_block_pages
    assert stats["extend_calls"] > 0 and 2 in blocks
    _check_against_reference(params, prompts, ref, result, script, G=2)


def test_a_per_turn_cap_cuts_turns(setup):
    params, prompts, ref = setup
    script = Script(turns=4, delay=lambda p, g, t: 1)
    result, stats, _ = _run(params, prompts[:3], script, slots=4, G=1, cap=5)
    calls = _check_against_reference(params, prompts[:3], ref, result, script, G=1, cap=5)
    assert any(cut for *_, cut in calls) and any(not cut for *_, cut in calls)
    for per, masks in zip(result.samples, result.model_masks):
        mask = masks[0].tolist()
        turns = "".join(map(str, mask)).split("0")
        assert max(len(t) for t in turns) <= 5 and len(mask) == per[0][0].size


def test_memory_pressure_releases_waiting_pages_and_prefills_them_again(setup):
    params, prompts, ref = setup
    script = Script(turns=3, delay=lambda p, g, t: 4)
    # 4 slots, pages for about two whole trajectories: waiting samples' pages must go.
    result, stats, engine = _run(params, prompts, script, slots=4, pool_tokens=4 * 34)
    _check_against_reference(params, prompts, ref, result, script, G=2)
    assert stats["waiting_released"] > 0 and stats["refilled"] > 0
    assert engine.pool.all_free()


def test_a_stop_while_samples_wait_returns_their_tokens_so_far(setup):
    params, prompts, ref = setup
    full, _, _ = _run(params, prompts, Script(turns=3, delay=lambda p, g, t: 3), slots=3)
    script = Script(turns=3, delay=lambda p, g, t: 3)
    result, stats, engine = _run(params, prompts, script, slots=3,
                                 stop_fn=lambda done, n: n >= 60)
    assert engine.pool.all_free() and engine.kept == {}
    waited = [c[0] for c in script.calls]   # samples whose environment was asked
    assert result.unfinished and any(k in result.unfinished for k in waited)
    for p, per in enumerate(result.samples):
        for g, (tokens, logps) in enumerate(per):
            want, want_lp = full.samples[p][g]
            n = tokens.size
            assert tokens.tolist() == want[:n].tolist()
            np.testing.assert_allclose(logps, want_lp[:n], atol=1e-6)
            assert result.model_masks[p][g].tolist() == full.model_masks[p][g][:n].tolist()
            assert (result.ends[p][g] == "cut") == ((p, g) in result.unfinished)
    # Some sample was stopped while it waited on its tool: its tokens are those its tool
    # last saw, its whole last turn kept.
    last_seen = {c[0]: c[1] for c in script.calls}
    assert any(result.samples[p][g][0].tolist() == last_seen.get((p, g))
               for p, g in result.unfinished)


def test_observations_must_fit_the_room(setup):
    params, prompts, _ = setup

    class TooLong(Script):
        def answer(self, key, t, room):
            return np.ones(room + 1, np.int32)

    with pytest.raises(ValueError, match=r"sample \(0, 0\)'s observation must be 1 to \d+"):
        _run(params, prompts[:1], TooLong(), slots=1, G=1)

    class Fill(Script):   # an observation that fills the room ends the sample: "length"
        def answer(self, key, t, room):
            return np.ones(room, np.int32)

    result, _, engine = _run(params, prompts[:2], Fill(), slots=2, G=1)
    for p in range(2):
        assert result.ends[p][0] == "length" and result.samples[p][0][0].size == LIMIT
        assert result.model_masks[p][0][-1] == 0
    assert engine.pool.all_free()


def test_a_second_multi_turn_rollout_compiles_nothing(setup):
    """The observation prefill is one program per bucketed length: a rollout with the same
    lengths' buckets compiles nothing new."""
    params, prompts, _ = setup
    request = rollout.Request(prompts, LIMIT, 2, eos_ids=EOS, turns=Script(),
                              turn_end_ids=TURN_END)
    engine = rollout.engine_for(CFG, request, max_slots=3, **_engine_sizes())
    policy = rollout.Policy(steps_per_call=4)
    scheduler.run(engine, params, request, policy=policy)
    before = compiles.snapshot()
    again = rollout.Request(prompts, LIMIT, 2, seed=1, eos_ids=EOS, turn_end_ids=TURN_END,
                            turns=Script(delay=lambda p, g, t: (p * g + 1) % 4))
    scheduler.run(engine, params, again, policy=policy)
    assert compiles.since(before) == {}


@pytest.mark.optimized
def test_sampled_turns_draw_the_same_tokens_whether_pages_stay_or_go(setup, monkeypatch):
    """A sample's draws are keyed by (sample, model tokens so far) across its turns, so a
    sampled rollout whose waiting samples' pages are released and prefilled again draws what
    one with room for every page draws."""
    params, prompts, _ = setup
    kw = dict(sampling=rollout.SamplingParams(1.0), seed=3)
    plans, run_insert = [], rollout.Engine.run_insert

    def recording(self, state, ps):
        plans.extend(ps)
        return run_insert(self, state, ps)

    monkeypatch.setattr(rollout.Engine, "run_insert", recording)
    roomy, _, _ = _run(params, prompts, Script(turns=3, delay=lambda p, g, t: 4), slots=4,
                       **kw)
    # Each resumed turn goes on from the model tokens its sample drew before, not from 0.
    resumed = [x for x in plans if x.prefix is None]
    assert len(resumed) > len(prompts)
    for x in resumed:
        p, g = divmod(x.sample_id, 2)
        before = x.length + 1 - len(prompts[p])   # its tokens after the prompt
        assert x.steps == roomy.model_masks[p][g][:before].sum() > 0
    tight, stats, _ = _run(params, prompts, Script(turns=3, delay=lambda p, g, t: 4), slots=4,
                           pool_tokens=4 * 34, **kw)
    assert stats["refilled"] > 0
    for p in range(len(prompts)):
        for g in range(2):
            assert tight.samples[p][g][0].tolist() == roomy.samples[p][g][0].tolist()
            np.testing.assert_allclose(tight.samples[p][g][1], roomy.samples[p][g][1],
                                       atol=2e-5)
    # Two samples of one prompt draw apart.
    assert roomy.samples[0][0][0].tolist() != roomy.samples[0][1][0].tolist()


def test_either_turn_order_samples_the_same_trajectories_and_laggards_go_first(setup):
    """`Policy.turn_order`: which waiting sample a free slot takes changes when a trajectory
    runs, never what it samples; "least_progress" (new trajectories, then the fewest turns
    done) ends the batch in no more decode steps than "arrival" (resumed ones as they come),
    which starts late trajectories only once none is queued to resume."""
    params, prompts, _ = setup
    room = len(prompts) * 2 * (max(map(len, prompts)) + LIMIT + 8)
    out = {}
    for order in ("least_progress", "arrival"):
        script = Script(turns=3, delay=lambda p, g, t: 1)
        request = rollout.Request(prompts, LIMIT, 2, eos_ids=EOS, turns=script,
                                  turn_end_ids=TURN_END)
        engine = rollout.engine_for(CFG, request, max_slots=3, pool_tokens=room,
                                    **_engine_sizes())
        stats = {}
        out[order] = (scheduler.run(engine, params, request, stats=stats, policy=rollout.Policy(
            steps_per_call=SIZES["steps_per_call"], turn_order=order)), stats)
    (a, sa), (b, sb) = out["least_progress"], out["arrival"]
    for p in range(len(prompts)):
        for g in range(2):
            assert a.samples[p][g][0].tolist() == b.samples[p][g][0].tolist()
            assert a.model_masks[p][g].tolist() == b.model_masks[p][g].tolist()
    assert sa["decode_steps"] <= sb["decode_steps"]
    print(f"\ndecode steps: least_progress {sa['decode_steps']}, arrival {sb['decode_steps']}; "
          f"occupancy {sa['slot_occupancy']:.2f} vs {sb['slot_occupancy']:.2f}")
    with pytest.raises(ValueError, match="turn_order"):
        rollout.Policy(turn_order="fifo")
