"""Partial rollouts of multi-turn trajectories (`rollout.partial` with `rollout.env`,
`lrl.partial_turns`): greedy trajectories cut by the partial stop (mid-turn, and while waiting
on their environment) and carried over several steps are, token for token and mask for mask,
the trajectories of one uncut rollout, with each token's policy version that of the step that
drew it; the carried turn state round-trips through the checkpoint's data state."""
import dataclasses
import json

import numpy as np
import pytest

from lrl import collect, collect_partial, models
from lrl.rollout import partial
from lrl.tasks import Prompt
from tests.test_multiturn_train import _bigram_params, _rl, _setup
from tests.test_multiturn_train import KW

@pytest.fixture(scope="module")
def tok():
    from lrl.data import synthetic
    from lrl.data import tokenizer as tok_lib
    corpus = synthetic.synthetic_corpus(300, 0, tasks=("tool_lookup",),
                                        task_kwargs={"tool_lookup": KW})
    return tok_lib.build_tokenizer(corpus, 320, tools=True)


TURN_LEN = 24   # a model turn longer than a decode call (16 steps): a stop can cut it


def _case(tok, budget):
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    nl, eos = ids("\n")[0], tok.eos_token_id
    think = [tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<tool_call>",
                                                    "</tool_call>")]
    filler = [i for i in range(100, 200) if i not in (nl, eos, *think)][:TURN_LEN - 6]
    turn = [think[0], *filler, think[1], think[2], ids("b")[0], think[3], eos]
    assert len(set(turn)) == len(turn) == TURN_LEN
    cfg = models.ModelConfig(model_type="qwen2", vocab_size=len(tok), d_model=64, n_layers=1,
                             n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=64, remat="none",
                             tie_embeddings=False)
    params = _bigram_params(cfg, dict(zip([nl] + turn[:-1], turn)))
    base = _setup()
    ro = dataclasses.replace(base.rollout, env="test_always_answers", max_turns=3,
                             turn_reward="sum", partial=True, partial_tokens=budget,
                             overlap_admission=False, max_slots=8, max_staleness=10)
    s = dataclasses.replace(base, tokenizer=tok, model_cfg=cfg, eos_ids=(eos,), rollout=ro,
                            rl=_rl(max_new_tokens=128, temperature=0.0, group_size=2,
                                   prompts_per_step=2))
    msgs = lambda k: [{"role": "user", "content": f"Look up key a{k}."}]  # noqa: E731
    prompts = [Prompt(np.asarray(tok.apply_chat_template(msgs(k), add_generation_prompt=True,
                                                         tokenize=True, return_dict=False),
                                 np.int32), "42", {}, "") for k in range(2)]
    return s, params, prompts, turn, eos


def test_greedy_trajectories_cut_and_carried_equal_the_uncut_ones(tok):
    s, params, prompts, turn, eos = _case(tok, budget=20)
    want = collect.rollout_groups(s, params, prompts, group_size=2, seed=0)
    assert all(r["turns"] == 3 and r["end"] == "max_turns" for r in want.trajectories)
    carry, new, got, steps, cuts = (), prompts, {}, 0, set()
    while len(got) < len(prompts):
        groups, carry, m = collect_partial.partial_rollout(s, params, carry, new, steps,
                                                           seed=steps)
        for x in (x for g in carry for x in g.samples if x.tokens.size and not x.done):
            # where the stop cut it: mid model turn, or after an observation (its step ran
            # out while the sample waited, or it waited for a slot)
            cuts.add("mid_turn" if x.mask[-1] and x.tokens[-1] != eos else
                     "after_observation" if not x.mask[-1] else "waiting")
            assert x.turn is not None and x.mask.shape == x.tokens.shape == x.versions.shape
        for p in range(groups.P):
            got[groups.prompts[p].ids.tobytes()] = (groups, p, steps)
        new, steps = [], steps + 1
        assert steps < 12
    assert steps >= 4 and {"mid_turn", "after_observation"} <= cuts, cuts
    for w, prompt in enumerate(prompts):
        groups, p, step = got[prompt.ids.tobytes()]
        for g in range(2):
            i, j = 2 * p + g, 2 * w + g
            np.testing.assert_array_equal(groups.completions[i], want.completions[j])
            np.testing.assert_array_equal(groups.masks[i], want.masks[j])
            model = want.masks[j] > 0
            np.testing.assert_allclose(groups.logps[i][model], want.logps[j][model], atol=1e-5)
            rec, ref = groups.trajectories[i], want.trajectories[j]
            assert {k: rec[k] for k in ("turns", "end", "tool_calls", "model_tokens")} == \
                {k: ref[k] for k in ("turns", "end", "tool_calls", "model_tokens")}
            # drawn over several steps: its age counts from its oldest token (step 0)
            assert groups.sample_ages()[i] == step


def test_versions_are_the_steps_that_drew_each_token(tok):
    s, params, prompts, *_ = _case(tok, budget=20)
    carry, (groups, carry, _) = (), collect_partial.partial_rollout(s, params, (), prompts, 0,
                                                                   seed=0)
    for step in (1, 2):
        groups, carry, m = collect_partial.partial_rollout(s, params, carry, [], step,
                                                           seed=step)
        for x in (x for g in carry for x in g.samples if not x.done):
            v = x.versions
            assert (np.diff(v) >= 0).all() and v[0] == 0 and v[-1] == step
            # each step drew a decode call's 16 tokens (and maybe an observation)
            assert ((v == step) & (x.mask > 0)).sum() <= 16


def test_carried_trajectories_round_trip_through_the_data_state(tok):
    """A step's carried trajectories saved as the checkpoint saves them (JSON, bytes as
    base64) and read back resume to the same trajectories as those never saved."""
    from lrl import checkpoint_items as ci
    from lrl import tasks
    s, params, prompts, *_ = _case(tok, budget=20)
    _, carry, _ = collect_partial.partial_rollout(s, params, (), prompts, 0, seed=0)
    _, carry, _ = collect_partial.partial_rollout(s, params, carry, [], 1, seed=1)
    saved = json.loads(json.dumps(ci.encode_data(partial.to_state(carry, tasks.prompt_to_state))))
    back = partial.from_state(ci.decode_data(saved), tasks.prompt_from_state)
    for a, b in zip((x for g in back for x in g.samples), (x for g in carry for x in g.samples)):
        for f in ("tokens", "logps", "versions", "mask"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert a.turn.live.traj == b.turn.live.traj and a.turn.live.start == b.turn.live.start
    runs = [collect_partial.partial_rollout(s, params, c, [], 2, seed=2) for c in (carry, back)]
    (ga, ca, _), (gb, cb, _) = runs
    for a, b in zip((x for g in ca for x in g.samples), (x for g in cb for x in g.samples)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.mask, b.mask)
    bad = json.loads(json.dumps(saved))
    bad[0]["samples"][0]["mask"] = [1]
    with pytest.raises(ValueError, match="carried group 0: ValueError: .* a model mask of 1"):
        partial.from_state(ci.decode_data(bad), tasks.prompt_from_state)


from lrl.envs import base as env_base   # noqa: E402


@env_base.register("test_parity_answers")
class _ParityAnswers(env_base.Environment):
    """Answers every model turn with a tool result, rewarding turns of an odd length: every
    trajectory runs `max_turns` turns, and a group's rewards differ (a gradient)."""
    role = "tool"

    def step(self, turn_text, turn_tokens):
        return env_base.Step("42", float(len(turn_tokens) % 2), False, {"tool_calls": 1})


def _tools_config(steps):
    from lrl import config_util
    from tests.test_partial import ROOT
    c = config_util.load(f"{ROOT}/configs/default.py", "tools_runlocal")
    c.mesh.update(fsdp=4, tensor=2)   # the suite's 8 devices
    c.rl.steps = steps
    c.eval.every = 0
    c.rl.shared_prompt = "on"   # each group's prompt once in the update's rows
    # a budget of 48 sampled tokens a step: the first decode call of the 16 trajectories (3
    # turns each) stops the rollout, and they run on over the next steps
    c.rollout.update(partial=True, partial_tokens=48, max_staleness=4, partial_tail=0.0,
                     partial_backlog=0.0, env="test_parity_answers")
    return c


def _same(row):
    from tests.test_partial import _compared
    return {k: v for k, v in _compared(row).items() if "tool_s" not in k}


@pytest.mark.slow
@pytest.mark.optimized
def test_tools_loop_with_partial_rollouts_resumes_mid_trajectory_as_the_uncut_run(
        tmp_path, monkeypatch):
    """`tools_runlocal` with `rollout.partial` and the shared-prompt layout: trajectories
    carried across steps train end to end, and a run stopped (SIGTERM) with trajectories
    carried mid-way, then resumed from its checkpoint, logs what the uninterrupted run logs,
    step for step. (The SFT warm start stays: a random model's turns rarely end, and the
    trained steps' trajectories must have several turns.)"""
    from lrl import build as build_lib
    from lrl import loop
    from lrl.envs import driver as driver_lib
    from tests.test_partial import _assert_rows_match, _rows, _run_cut
    # Environment steps in the driver's own process, each ready at its turn's end: with the
    # pool's threads (reward.num_workers=0) a step may or may not be done by the scheduler's
    # next poll, which moves where the token budget cuts the trajectories, so two runs (the
    # straight and the resumed) could differ for a reason that is not the resume.
    real = driver_lib.Driver
    monkeypatch.setattr(driver_lib, "Driver", lambda *a, **k: real(*a, **{**k, "pool": None}))
    loop.run(_tools_config(5), str(tmp_path / "straight"))
    want = [r for r in _rows(tmp_path / "straight") if "partial/carried_samples" in r]
    assert [r["step"] for r in want] == [21, 22, 23, 24, 25]   # after 20 SFT steps
    assert sum(r["partial/carried_samples"] for r in want) > 0
    assert sum(r["partial/trained_groups"] for r in want) > 0
    trained = [r for r in want if r["partial/trained_groups"]]
    assert all(np.isfinite(r["loss"]) and r["turns/turns_mean"] > 1 for r in trained)
    assert any(r["loss"] != 0 for r in trained)
    assert all(r["pack/shared_frac"] > 0 for r in trained)
    assert max(r["partial/version_span_max"] for r in want) >= 1
    cut = _run_cut(tmp_path / "cut", _tools_config(5), build_lib.grpo, monkeypatch, at=22)
    assert cut[-1]["partial/carried_samples"] > 0   # the checkpoint holds trajectories mid-way
    got = [r for r in _rows(tmp_path / "cut") if "partial/carried_samples" in r]
    assert [r["step"] for r in got] == [21, 22, 23, 24, 25]
    _assert_rows_match(got, want, _same)
