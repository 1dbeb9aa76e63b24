"""ReMax's greedy baseline: the rollout draws one temperature-0 sample per prompt when the
estimator asks for a baseline, scores it with the same reward pool, carries it in Groups (never
trained on) and the step's advantages subtract it. Sampling and scoring are faked here."""
import json
import types

import numpy as np
import pytest

from lrl import collect, grpo, pipeline
from lrl.groups import Groups
from lrl.tasks import Prompt


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


class _Pool:
    """Reward = the first token / 10 of the completion."""
    def __init__(self):
        self.calls = []

    def score(self, items):
        self.calls.append(len(items))
        return [float(t.split()[0]) / 10 for t, _, _ in items], {"n_items": len(items)}


def _setup(estimator, dynamic=False, P=2, G=3):
    rl_ = types.SimpleNamespace(estimator=estimator, group_size=G, prompts_per_step=P,
                                dynamic_sampling=dynamic, max_resample=2, max_new_tokens=4,
                                temperature=1.0)
    prompts = [Prompt(np.array([10 * (p + 1)], np.int32), "", {}, f"p{p}") for p in range(P)]
    task = types.SimpleNamespace(prepare=lambda params, raw: (list(prompts), {}))
    return types.SimpleNamespace(rl=rl_, rollout=types.SimpleNamespace(env=""), seed=0,
                                 task=task, pool=_Pool(), tokenizer=_Tok(), prefill=None,
                                 eos_ids=(0,))


def _fake_generate(calls):
    def generate(s, params, ids, *, group_size, seed, temperature=None, stats=None, **kw):
        calls.append((len(ids), group_size, temperature))
        if temperature == 0.0:   # greedy: token = prompt id / 10 + 5, one sample per prompt
            return [[(np.array([int(i[0]) // 10 + 5, 0]), np.zeros(2))] for i in ids]
        # sampled: tokens g + prompt id / 10
        return [[(np.array([g + int(i[0]) // 10, 0]), np.zeros(2)) for g in range(group_size)]
                for i in ids]
    return generate


@pytest.mark.parametrize("dynamic", [False, True])
def test_collect_scores_a_greedy_baseline_for_remax(monkeypatch, dynamic):
    calls = []
    monkeypatch.setattr(collect, "_generate", _fake_generate(calls))
    s = _setup("remax", dynamic)
    groups, m = collect.collect(s, None, iter([0, 1, 2]), step=0)
    # rewards: prompt p (id 10(p+1)) sample g -> (g + p + 1) / 10; greedy -> (p + 1 + 5) / 10
    np.testing.assert_allclose(groups.rewards_PG, [[0.1, 0.2, 0.3], [0.2, 0.3, 0.4]], rtol=1e-6)
    np.testing.assert_allclose(groups.baseline_P, [0.6, 0.7], rtol=1e-6)
    assert calls[-1] == (2, 1, 0.0)            # one greedy sample per prompt, temperature 0
    assert len(groups.completions) == 6        # the baseline samples are not trained on
    np.testing.assert_allclose(m["reward/baseline_mean"], 0.65, rtol=1e-6)
    adv = grpo.advantages(groups, "remax", pad_P=3)
    np.testing.assert_allclose(adv, [[-0.5, -0.4, -0.3], [-0.5, -0.4, -0.3]], rtol=1e-5)
    # a subset keeps its baselines
    np.testing.assert_allclose(groups.take(np.array([False, True])).baseline_P, [0.7])


def test_no_baseline_when_the_estimator_does_not_ask(monkeypatch):
    calls = []
    monkeypatch.setattr(collect, "_generate", _fake_generate(calls))
    s = _setup("grpo")
    groups, m = collect.collect(s, None, iter([0]), step=0)
    assert groups.baseline_P is None and "reward/baseline_mean" not in m
    assert [c[2] for c in calls] == [None]     # no greedy call
    with pytest.raises(ValueError, match="remax needs baseline_P"):
        grpo.advantages(groups, "remax")


def test_pipeline_state_keeps_the_baseline():
    from lrl.checkpoint_items import decode_data, encode_data
    prompts = (Prompt(np.array([3], np.int32), "7", {}, "a"),
               Prompt(np.array([6], np.int32), "1", {}, "b"))
    logps = tuple(np.zeros(2, np.float32) for _ in range(4))
    g = Groups(prompts, tuple(np.ones(2, np.int32) for _ in range(4)), logps, 2,
               np.zeros(4, bool), ("a", "b", "c", "d"), np.ones((2, 2), np.float32),
               np.zeros(4, np.int32), np.array([0.25, 0.5], np.float32))
    state = json.loads(json.dumps(encode_data(pipeline.to_state(pipeline.Batch(g, {})))))
    back = pipeline.from_state(decode_data(state)["pipeline_batch"]).groups
    np.testing.assert_array_equal(back.baseline_P, [0.25, 0.5])
    no_base = decode_data(state)["pipeline_batch"]
    del no_base["baseline"]                    # a checkpoint written before ReMax
    assert pipeline.from_state(no_base).groups.baseline_P is None
