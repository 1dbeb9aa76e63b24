"""Partial rollouts with DAPO's dynamic sampling and with reinforce_pp. Dynamic sampling: a
complete group whose rewards are all equal is dropped and counted, only kept groups count
towards rl.prompts_per_step, and the rollout admits more prompts for them, round after
round, until it has them, a budget stops it or rl.max_resample is reached. reinforce_pp: a
step training fewer groups than prompts_per_step whitens over its own samples, as the
estimator over those samples alone does, and compiles nothing new for the count. Both run
through the real loop on the tiny model."""
import dataclasses

import numpy as np
import pytest

from lrl import collect_partial, compiles, grpo, loop, rl
from lrl.groups import Groups
from lrl.tasks import Prompt
from tests.test_partial import _loop_config, _params, _rows, _setup


class _Task:
    def prepare(self, params, raw):
        return list(raw), {}


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Pool:
    """Rewards by prompt: a group of an answer starting "u" scores 1 everywhere (uniform, no
    signal), any other scores its sample's index in the group (0, 1: informative)."""
    def score(self, items):
        r = [1.0 if answer.startswith("u") else float(i % 2)
             for i, (_, answer, _) in enumerate(items)]
        return np.asarray(r, np.float32), {"n_items": float(len(items))}


def _batches(*answers):
    """One batch of prompts per tuple of answers, each prompt its own ids."""
    rng = np.random.RandomState(0)
    return iter([[Prompt(rng.randint(1, 64, 5 + i).astype(np.int32), a, {}, "")
                  for i, a in enumerate(batch)] for batch in answers])


def _dynamic(max_resample=2, partial_tokens=0):
    s = _setup(max_slots=8, partial_tokens=partial_tokens, prompts_per_step=2)
    # Every sample ends after 3 tokens: a round's groups all finish in its first decode call.
    return dataclasses.replace(
        s, rl=dataclasses.replace(s.rl, dynamic_sampling=True, max_resample=max_resample),
        task=_Task(), tokenizer=_Tokenizer(), pool=_Pool(), max_new_fn=lambda key: 3)


def _answers(groups):
    return [p.answer for p in groups.prompts]


def test_partial_dynamic_sampling_drops_uniform_groups_and_rolls_on_for_kept_ones():
    s, params = _dynamic(), _params(1)
    it = _batches(("u1", "i1"), ("i2", "u2"), ("u3", "i3"), ("i4", "i5"))
    groups, m, carry = collect_partial.collect_partial(s, params, it, 0, ())
    # u1 dropped, i1 kept; a second round admits the next batch, of whose two complete groups
    # the older, i2, is the one still wanted; u2, complete, is carried unscored.
    assert _answers(groups) == ["i1", "i2"]
    np.testing.assert_array_equal(groups.rewards_PG, [[0, 1], [0, 1]])
    assert (m["partial/dropped_uniform_groups"], m["partial/rounds"]) == (1, 2)
    assert (m["groups/draws"], m["groups/kept"], m["partial/trained_groups"]) == (2, 2, 2)
    assert m["groups/informative_frac"] == 2 / 3 and m["reward/n_items"] == 6
    assert m["partial/new_groups"] == 4 and m["partial/carried_complete_groups"] == 1
    assert [g.prompt.answer for g in carry] == ["u2"]
    # The next step scores the carried u2 first (the oldest), drops it and u3, keeps i3, and
    # draws once more for the second group.
    groups, m, carry = collect_partial.collect_partial(s, params, it, 1, carry)
    assert _answers(groups) == ["i3", "i4"] and groups.sample_ages().tolist() == [0] * 4
    assert (m["partial/dropped_uniform_groups"], m["groups/draws"], m["groups/kept"]) == (2, 2, 2)
    assert m["groups/informative_frac"] == 2 / 4 and [g.prompt.answer for g in carry] == ["i5"]
    # The step trains them as scored (advantages of the kept groups only).
    adv = grpo.advantages(groups, s.rl.estimator, pad_P=2)
    assert np.all(adv[:, 0] < 0) and np.all(adv[:, 1] > 0)


def test_partial_dynamic_sampling_stops_at_max_resample_and_on_a_spent_budget():
    for s in (_dynamic(max_resample=0), _dynamic(partial_tokens=1)):
        groups, m, carry = collect_partial.collect_partial(
            s, _params(1), _batches(("u1", "i1"), ("i2", "i3")), 0, ())
        # One round only: its uniform group dropped, one group trained, no second draw.
        assert _answers(groups) == ["i1"] and carry == ()
        assert (m["partial/rounds"], m["groups/draws"], m["groups/kept"]) == (1, 1, 1)
        assert m["partial/dropped_uniform_groups"] == 1


def test_partial_dynamic_sampling_with_only_uniform_groups_trains_nothing():
    s = _dynamic(max_resample=1)
    groups, m, carry = collect_partial.collect_partial(s, _params(1), _batches(("u1", "u2"), ("u3", "u4")),
                                               0, ())
    assert groups.P == 0 and carry == () and m["groups/kept"] == 0
    assert m["partial/dropped_uniform_groups"] == 4 and m["groups/informative_frac"] == 0.0


def _groups(rewards_PG, lengths_PG):
    G = rewards_PG.shape[1]
    return Groups(tuple(Prompt(np.ones(2, np.int32), "", {}, "") for _ in rewards_PG),
                          tuple(np.ones(n, np.int32) for n in lengths_PG.reshape(-1)),
                          (), G, np.zeros(rewards_PG.size, bool),
                          rewards_PG=np.asarray(rewards_PG, np.float32))


def test_a_partial_steps_reinforce_pp_whitens_over_its_own_samples_with_no_new_compile():
    rng = np.random.default_rng(0)
    for estimator in ("reinforce_pp", "reinforce_pp_token"):
        for P in (1, 2, 3, 5):
            rewards = rng.integers(0, 3, (P, 4)).astype(np.float32)
            rewards[0] = [0, 1, 0, 1]   # at least one informative group
            lengths = rng.integers(1, 30, (P, 4))
            got = grpo.advantages(_groups(rewards, lengths), estimator, pad_P=5)
            want = np.asarray(rl.advantages(rewards, estimator, lengths_PG=lengths))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"P={P}")
            if P < 5 and estimator == "reinforce_pp":   # zero rows alone would not do
                zero = np.pad(rewards, ((0, 5 - P), (0, 0)))
                assert not np.allclose(np.asarray(rl.advantages(zero, estimator))[:P], want)
        # Any count, one shape: nothing compiles again.
        before = compiles.snapshot()
        for P in (4, 1, 3):
            grpo.advantages(_groups(np.tile([[0.0, 1, 1, 0]], (P, 1)), np.ones((P, 4), int)),
                            estimator, pad_P=5)
        assert compiles.since(before) == {}, compiles.since(before)


@pytest.mark.slow
@pytest.mark.optimized
def test_tiny_loop_runs_partial_rollouts_with_dynamic_sampling(tmp_path):
    c, build = _loop_config(steps=5)
    c.rl.dynamic_sampling = True
    c.rollout.partial_tokens = 0   # rounds go on until the kept groups are in hand
    loop.run(c, str(tmp_path), build=build)
    steps = [r for r in _rows(tmp_path) if "compiles/step" in r]
    assert len(steps) == 5
    P = c.rl.prompts_per_step
    for r in steps:
        assert r["groups/kept"] == r["partial/trained_groups"] <= P
        assert r["partial/rounds"] <= 1 + c.rl.max_resample
        if r["groups/kept"]:
            assert np.isfinite(r["loss"])
    assert sum(r["partial/dropped_uniform_groups"] for r in steps) > 0
    # Groups were dropped in a step that still trained prompts_per_step kept ones.
    assert any(r["partial/dropped_uniform_groups"] and r["groups/kept"] == P for r in steps)
    assert [r["compiles/step"] for r in steps[2:]] == [0] * 3, [r["compiles/step"] for r in steps]


@pytest.mark.slow
@pytest.mark.optimized
def test_tiny_loop_runs_partial_rollouts_with_reinforce_pp(tmp_path, monkeypatch):
    c, build = _loop_config(steps=5)
    c.rl.estimator = "reinforce_pp"
    c.rollout.partial_backlog = 0.0   # no samples waiting: some steps finish fewer groups
    seen, real = [], grpo.advantages
    monkeypatch.setattr(grpo, "advantages", lambda groups, *a, **k: seen.append(
        (groups, real(groups, *a, **k))) or seen[-1][1])
    loop.run(c, str(tmp_path), build=build)
    steps = [r for r in _rows(tmp_path) if "compiles/step" in r]
    assert len(steps) == 5 and len(seen) == sum(r["partial/trained_groups"] > 0 for r in steps)
    assert any(g.P < c.rl.prompts_per_step for g, _ in seen)
    for groups, adv in seen:
        np.testing.assert_allclose(adv, np.asarray(rl.advantages(groups.rewards_PG,
                                                                 "reinforce_pp")),
                                   rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(r["loss"]) for r in steps if r["partial/trained_groups"])
    assert [r["compiles/step"] for r in steps[2:]] == [0] * 3, [r["compiles/step"] for r in steps]


def test_a_partial_step_draws_prompts_until_a_backlog_waits_behind_the_full_slots():
    """`rollout.partial_backlog`: batches (of 2 groups x 2 samples) are drawn until the
    unfinished samples fill the slots and that many steps' samples wait behind them; none
    while the carried groups alone hold a step's complete groups; with 0, one batch while the
    slots are not full."""
    def run(backlog, slots):
        s = _setup(max_slots=slots, partial_tokens=0, prompts_per_step=2)
        s = dataclasses.replace(s, rollout=dataclasses.replace(s.rollout,
                                                               partial_backlog=backlog),
                                task=_Task(), tokenizer=_Tokenizer(), pool=_Pool(),
                                max_new_fn=lambda key: 3)
        it, carry, out = _batches(*[(f"a{i}", f"b{i}") for i in range(9)]), (), []
        for step in range(3):
            groups, m, carry = collect_partial.collect_partial(s, _params(1), it, step, carry)
            out.append((_answers(groups), m["partial/new_groups"],
                        [g.prompt.answer for g in carry]))
        return out

    # Every sample ends in the first decode call, and the step stops once it is collected:
    # 4 slots + 4 waiting: two batches, the second's groups carried unstarted, and a batch a
    # step after that.
    assert run(1.0, 4) == [(["a0", "b0"], 4, ["a1", "b1"]), (["a1", "b1"], 2, ["a2", "b2"]),
                           (["a2", "b2"], 2, ["a3", "b3"])]
    # 8 slots, more than a step's 4 samples: those 4 + 4 waiting, two batches; every sample
    # gets a slot and finishes, so the next step has its two complete groups, draws none and
    # decodes nothing.
    assert run(1.0, 8) == [(["a0", "b0"], 4, ["a1", "b1"]), (["a1", "b1"], 0, []),
                           (["a2", "b2"], 4, ["a3", "b3"])]
    assert run(0.0, 4) == [(["a0", "b0"], 2, []), (["a1", "b1"], 2, []), (["a2", "b2"], 2, [])]
    half = lambda slots: dataclasses.replace(_setup(max_slots=slots).rollout,  # noqa: E731
                                             partial_backlog=0.5)
    three = _setup(prompts_per_step=3).rl   # groups of 2: 6 samples a step
    assert collect_partial.backlog(half(4), three) == 4 + 3        # the slots + ceil(0.5 x 6)
    assert collect_partial.backlog(half(128), three) == 6 + 3      # a step's samples, not the slots'
