"""Environments (lrl.envs): tools and their parsing, observation ids from a chat-template diff,
and the multi-turn Driver run by a scripted scheduler, in process and in the reward pool's
workers (environments that end early, error and hang; the pool recovers)."""
from __future__ import annotations

import re
import time

import jinja2
import numpy as np
import pytest

from lrl import envs, rewards
from lrl.envs import tools
from lrl.envs.base import Environment, Step
from lrl.envs.tool_env import ToolCall, parse_tool_calls

# ----- a fake tokenizer: one id per character, plus special and added tokens ------------------

SPECIAL = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|python_tag|>", "<|eom_id|>"]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
IM_END, TOOL_CALL_END = 2, 6

# Qwen2.5's rendering of tool messages (grouped under one user turn).
PLAIN = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# As Qwen3's: earlier assistant turns lose their <think> block, and the last assistant message
# gets an empty one (so the render without the new messages is not a prefix of the one with).
THINK_DROPPING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m.content %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if m.role == 'assistant' and loop.last and '<think>' not in content %}"
    "{%- set content = '<think>\\n\\n</think>\\n\\n' + content %}{%- endif %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


class FakeTokenizer:
    """The parts of a transformers tokenizer that lrl.envs uses."""
    eos_token_id = IM_END

    def __init__(self, chat_template=PLAIN):
        self.chat_template = chat_template
        self.tokens = SPECIAL + ADDED
        self._re = re.compile("|".join(re.escape(t) for t in self.tokens) + "|.", re.S)

    def encode(self, text, add_special_tokens=False):
        return [self.tokens.index(m) if m in self.tokens else 100 + ord(m)
                for m in self._re.findall(text)]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (i < len(SPECIAL) and skip_special_tokens) else
                       self.tokens[i] if i < len(self.tokens) else chr(i - 100) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False,
                            chat_template=None, **kwargs):
        assert not tokenize
        return jinja2.Template(chat_template or self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)


TOK = FakeTokenizer()


# ----- tools and their parsing ------------------------------------------------------------

def test_calc_is_arithmetic_only():
    assert tools.call("calc", {"expression": "(3 + 4) * 12 / 5"}) == ("16.8", True)
    assert tools.call("calc", {"expression": "123456789 * 987654321"}) == \
        (str(123456789 * 987654321), True)
    for expr in ["-2 ** 3 + 7 // 2 % 3", "2 ** -2 * (1.5 - -3)", "-7 // 2", "(((1)))"]:
        assert tools.call("calc", {"expression": expr}) == (format(eval(expr), ".12g"), True)
    for bad in ["__import__('os').system('true')", "(1).real", "open('x')", "x + 1",
                "[1, 2]", "'a' * 3", "True + 1", "lambda: 1", "2 ** 10 ** 10", "9" * 2000,
                "1 / 0", "1e308 * 10", "(-8) ** 0.5", "1 +"]:
        text, ok = tools.call("calc", {"expression": bad})
        assert not ok and text.startswith("error: calc"), (bad, text)
    assert "not Call" in tools.call("calc", {"expression": "abs(-1)"})[0]
    assert "not Attribute" in tools.call("calc", {"expression": "(1).real"})[0]


def test_tool_arguments_are_validated_and_failures_are_observations():
    assert tools.call("calc", {}) == ("error: calc: missing required argument(s) "
                                      "['expression']", False)
    assert "unknown argument(s) ['x']" in tools.call("calc", {"expression": "1", "x": 2})[0]
    assert "must be of type string" in tools.call("calc", {"expression": 7})[0]
    assert "must be a JSON object" in tools.call("calc", ["1"])[0]
    assert "unknown tool 'rm'" in tools.call("rm", {})[0]
    assert "unknown tool 'calc'; available: lookup" in tools.call(
        "calc", {"expression": "1"}, allowed=["lookup"])[0]
    row = {"table": {"k1": 42, "k2": "v"}}
    assert tools.call("lookup", {"key": "k1"}, row) == ("42", True)
    assert tools.call("lookup", {"key": "k2"}, row) == ("v", True)
    assert tools.call("lookup", {"key": "k3"}, row) == ("no entry for 'k3'", True)
    assert tools.call("lookup", {"key": "k1"}, {}) == ("error: lookup: this task has no "
                                                       "table", False)
    spec = tools.get("calc").schema()["function"]
    assert spec["name"] == "calc" and spec["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="has no parameter"):
        tools.tool("bad_tool", "x", {"y": {"type": "string"}})(lambda x: x)
    with pytest.raises(ValueError, match="type"):
        tools.tool("bad_tool", "x", {"y": {"type": "str"}})


@tools.tool("test_boom", "Always fails.", {"n": {"type": "integer"}}, optional=["n"])
def _boom(n=0):
    raise RuntimeError("kaput")


def test_a_crashing_tool_is_an_observation():
    assert tools.call("test_boom", {}) == ("error: test_boom failed: RuntimeError: kaput", False)
    assert "must be of type integer" in tools.call("test_boom", {"n": True})[0]


def test_qwen_tool_calls_parse_and_malformed_ones_say_why():
    text = ('<think>maybe <tool_call>{"name": "calc"}</tool_call></think>Let me compute.\n'
            '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": {"expression": </tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "calc"')
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calc", {"expression": "1+1"}),
                         ToolCall("lookup", {"key": "a"})]
    assert "not valid JSON" in calls[2].error
    assert calls[3].error == 'a tool call needs a "name" string'
    assert calls[4].error == '"arguments" must be a JSON object'
    assert calls[5].error.startswith("unclosed <tool_call>")
    assert len(calls) == 6
    assert parse_tool_calls("The answer is \\boxed{4}.") == []
    assert parse_tool_calls("<think>I could call <tool_call></think>4") == []


def test_llama3_json_tool_calls_parse():
    one = '<|python_tag|>{"name": "calc", "parameters": {"expression": "2*3"}}'
    assert parse_tool_calls(one) == [ToolCall("calc", {"expression": "2*3"})]
    two = ('{"name": "calc", "parameters": {"expression": "1"}}; '
           '{"name": "lookup", "arguments": {"key": "b"}}')
    assert parse_tool_calls(two, "llama") == [ToolCall("calc", {"expression": "1"}),
                                              ToolCall("lookup", {"key": "b"})]
    bad = parse_tool_calls('{"name": "calc", "parameters": {"expression": ')
    assert len(bad) == 1 and "not valid JSON" in bad[0].error
    assert parse_tool_calls("It is 6.", "llama") == []
    assert parse_tool_calls(one, "qwen") == []       # the format is the model family's
    with pytest.raises(ValueError, match="format"):
        parse_tool_calls("x", "hermes")


def test_tool_env_answers_calls_and_scores_the_final_answer():
    env = envs.make("tools", reward="exact", tools=["calc"])
    env.reset({"answer": "12", "meta": {"extract": "boxed"}, "table": {"a": 1}})
    step = env.step('<tool_call>{"name": "calc", "arguments": {"expression": "3*4"}}</tool_call>'
                    '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
                    '<tool_call>oops</tool_call>', None)
    assert step.observation[0] == "12" and not step.done
    assert step.observation[1].startswith("error: unknown tool 'lookup'")
    assert step.observation[2].startswith("error: malformed tool call")
    assert step.info == {"tool_calls": 3, "tool_errors": 2}
    assert env.step("It is \\boxed{12}", None) == Step(None, 1.0, True)
    assert env.step("It is \\boxed{13}", None).reward == 0.0
    with pytest.raises(ValueError, match="answer"):
        env.reset({"question": "x"})
    # without a reward spec the env only ends the trajectory: the run's reward scores it
    plain = envs.make("tools")
    plain.reset({"question": "x"})
    assert plain.step("It is \\boxed{12}", None) == Step(None, 0.0, True)


def test_registry_names_the_registered_environments():
    assert "tools" in envs.names()
    with pytest.raises(ValueError, match="unknown environment; registered: .*tools"):
        envs.get("nope")
    with pytest.raises(ValueError, match="cannot import module"):
        envs.get("no_such_module:Env")
    assert envs.get("lrl.envs.tool_env:ToolEnv") is envs.ToolEnv
    with pytest.raises(TypeError, match="not an lrl.envs.Environment"):
        envs.make(lambda: object())


# ----- observation ids -----------------------------------------------------------------------

def _ids(text):
    return TOK.encode(text)


def test_observation_ids_close_the_turn_only_when_the_model_did_not():
    msgs = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "7"}]
    want = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
            "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # stopped at </tool_call>: the template's <|im_end|> closes the turn
    assert envs.observation_ids(TOK, msgs, last_token=TOOL_CALL_END) == _ids(want)
    # stopped at its own <|im_end|>: not appended twice
    assert envs.observation_ids(TOK, msgs, last_token=IM_END) == _ids(want)[1:]
    # Llama's <|eom_id|> stands in for the template's end id when both are end ids
    assert envs.observation_ids(TOK, msgs, last_token=4, end_ids=(IM_END, 4)) == _ids(want)[1:]
    with pytest.raises(ValueError, match="verbatim"):
        envs.observation_ids(TOK, msgs, chat_template="{{ messages[0].content }}")


def test_observation_ids_do_not_depend_on_a_template_that_drops_think_blocks():
    """The guessing game's user observations make Qwen3-like templates drop the earlier
    <think> block: re-rendering the history would change tokens the model already sampled."""
    prompt = [{"role": "user", "content": "Guess my number."}]
    turn = "<think>Middle first.</think>50"
    obs = [{"role": "user", "content": "higher"}]
    dropping = FakeTokenizer(THINK_DROPPING)
    ids = envs.observation_ids(dropping, obs, last_token=IM_END)
    assert ids == envs.observation_ids(TOK, obs, last_token=IM_END)
    assert dropping.decode(ids) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    # What the trajectory holds: prompt, the sampled turn, the ids appended.
    sampled = _ids(dropping.apply_chat_template(prompt, add_generation_prompt=True)) + \
        _ids(turn) + [IM_END] + ids
    # The plain template re-rendered in full gives the same tokens (a reference) ...
    full = prompt + [{"role": "assistant", "content": turn}] + obs
    assert sampled == _ids(TOK.apply_chat_template(full, add_generation_prompt=True))
    # ... and the think-dropping one would not: the naive diff the ids must not come from.
    assert sampled != _ids(dropping.apply_chat_template(full, add_generation_prompt=True))


# ----- the driver, run by a scripted scheduler ------------------------------------------------

class Countdown(Environment):
    """Ends after `n` turns (early with n=1); each turn rewards 0.5, and says how many are left
    as a user message."""
    role = "user"

    def __init__(self, n=3, fail=False, hang_s=0.0, bad=False):
        self.n, self.fail, self.hang_s, self.bad = n, fail, hang_s, bad

    def reset(self, row):
        self.left = row.get("n", self.n)
        return f"{self.left} turns"

    def step(self, turn_text, turn_tokens):
        if self.fail and "boom" in turn_text:
            raise ValueError("the environment broke")
        if self.hang_s and "hang" in turn_text:
            time.sleep(self.hang_s)
        if self.bad:
            return {"observation": "x"}
        self.left -= 1
        return Step(f"{self.left} left", 0.5, self.left == 0)


envs.register("test_countdown")(Countdown)


def run_scheduler(driver, turns, limit=1000):
    """Plays the scheduler: each key's scripted model turns (text, or (text, cut)), an end
    token after each (the </tool_call> when a turn ends with it, else <|im_end|>), observations
    appended as returned. -> ({key: tokens}, {key: model mask})."""
    tokens = {k: [] for k in turns}
    masks = {k: [] for k in turns}
    step = {k: 0 for k in turns}

    def model_turn(k):
        text, cut = turns[k][step[k]] if isinstance(turns[k][step[k]], tuple) else \
            (turns[k][step[k]], False)
        step[k] += 1
        ids = _ids(text) + ([] if cut or text.endswith("</tool_call>") else [IM_END])
        ids = ids[:limit - len(tokens[k])]
        tokens[k] += ids
        masks[k] += [1] * len(ids)
        if len(tokens[k]) < limit:
            driver.turn_ended(k, np.array(tokens[k], np.int32), limit - len(tokens[k]), cut)
            return True
        return False

    waiting = {k for k in turns if model_turn(k)}
    while waiting:
        for k, ids in driver.ready(block=True):
            waiting.remove(k)
            if ids is not None:
                assert 1 <= len(ids) <= limit - len(tokens[k]) and ids.dtype == np.int32
                tokens[k] += ids.tolist()
                masks[k] += [0] * len(ids)
                if model_turn(k):
                    waiting.add(k)
    return tokens, masks


def test_driver_runs_tool_turns_with_exact_tokens_in_process():
    row = {"answer": "56088", "reward": "exact", "meta": {"extract": "boxed"}}
    turn1 = ('<think>Too long by heart.</think><tool_call>{"name": "calc", "arguments": '
             '{"expression": "123 * 456"}}</tool_call>')
    turn2 = "<think>The tool says 56088.</think>\\boxed{56088}"
    obs = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
           "<|im_start|>assistant\n")
    for tok in (TOK, FakeTokenizer(THINK_DROPPING)):
        driver = envs.Driver("tools", [row, dict(row, answer="1")], tok, max_turns=4)
        tokens, masks = run_scheduler(driver, {(0, 0): [turn1, turn2], (1, 0): [turn2],
                                               (0, 1): ["\\boxed{56088}"]})
        assert tokens[(0, 0)] == _ids(turn1) + _ids(obs) + _ids(turn2) + [IM_END]
        assert masks[(0, 0)] == [1] * len(_ids(turn1)) + [0] * len(_ids(obs)) + \
            [1] * (len(_ids(turn2)) + 1)
        res = driver.results()
        assert res[(0, 0)].end == "done" and res[(0, 0)].reward == 1.0
        assert (res[(0, 0)].turns, res[(0, 0)].tool_calls, res[(0, 0)].tool_errors) == (2, 1, 0)
        assert res[(0, 0)].turn_rewards == [0.0, 1.0]
        assert res[(0, 0)].observed_tokens == len(_ids(obs))
        assert (res[(1, 0)].reward, res[(1, 0)].turns) == (0.0, 1)   # wrong answer, one turn
        assert res[(0, 1)].reward == 1.0
        m = driver.metrics()
        assert m["env/turns_mean"] == pytest.approx(4 / 3)
        assert (m["env/tool_calls"], m["env/end_done"], m["env/observed_tokens"]) == \
            (1, 3, len(_ids(obs)))


def test_driver_ends_max_turns_room_cut_and_error_with_counts():
    rows = [{"n": 1}, {"n": 5}]
    driver = envs.Driver("test_countdown", rows, TOK, max_turns=3, discount=0.5, group_size=3)
    assert driver.first_observation(1) == "5 turns"
    tokens, _ = run_scheduler(driver, {(0, 0): ["a"], (1, 0): ["a", "b", "c", "d"],
                                       (1, 1): ["a", ("bbbb", True)]})
    res = driver.results()
    assert (res[(0, 0)].end, res[(0, 0)].reward, res[(0, 0)].turns) == ("done", 0.5, 1)
    assert (res[(1, 0)].end, res[(1, 0)].turns) == ("max_turns", 3)
    assert res[(1, 0)].reward == pytest.approx(0.5 + 0.25 + 0.125)     # discounted
    assert (res[(1, 1)].end, res[(1, 1)].turns, res[(1, 1)].turn_rewards) == ("cut", 2, [0.5])
    assert res[(0, 1)].end == "length" and res[(0, 2)].turns == 0     # never ended a turn
    assert tokens[(1, 0)][-1] == IM_END                  # the third turn got no observation
    m = driver.metrics()
    assert (m["env/end_done"], m["env/end_max_turns"], m["env/end_cut"],
            m["env/end_length"], m["env/trajectories"]) == (1, 1, 1, 3, 6)

    obs_len = len(envs.observation_ids(TOK, [{"role": "user", "content": "4 left"}],
                                       last_token=IM_END))
    limit = 2 + obs_len - 1     # "a<|im_end|>", then room for all but one observation token
    for on_room, end, observed in (("end", "room", 0), ("truncate", "length", obs_len - 1)):
        driver = envs.Driver("test_countdown", [{"n": 5}], TOK, on_room=on_room)
        tokens, masks = run_scheduler(driver, {(0, 0): ["a", "b"]}, limit=limit)
        res = driver.results()[(0, 0)]
        assert (res.end, res.observed_tokens, len(tokens[(0, 0)])) == (end, observed,
                                                                       2 + observed)

    driver = envs.Driver("test_countdown", [{}], TOK, env_kwargs={"fail": True})
    run_scheduler(driver, {(0, 0): ["ok", "boom"], (0, 1): ["boom"]})
    res = driver.results()
    assert res[(0, 0)].end == "error" and res[(0, 0)].turn_rewards == [0.5]
    assert res[(0, 1)].error == "ValueError: the environment broke"
    assert driver.metrics()["env/errors"] == 2
    with pytest.raises(RuntimeError, match="nothing will ever be ready"):
        driver.ready(block=True)
    with pytest.raises(TypeError, match="pool must be a lrl.rewards.RewardPool"):
        envs.Driver("test_countdown", [{}], TOK, pool=object())
    with pytest.raises(ValueError, match="failed to reset on row 0"):
        envs.Driver("tools", [{"question": "no answer"}], TOK, env_kwargs={"reward": "math"})
    with pytest.raises(RuntimeError, match="which has error"):
        driver.turn_ended((0, 1), np.array([5]), 10, False)


# ----- the worker pool: submit / poll / cancel, and the driver in its processes ----------------

def _sleep_then(x, seconds):
    time.sleep(seconds)
    return x * 2


def _raise(msg):
    raise KeyError(msg)


@pytest.fixture(scope="module")
def pool():
    with rewards.RewardPool("exact", num_workers=2, timeout_s=5.0, fail_patience=0) as p:
        yield p


def test_pool_submit_poll_cancel_and_score_share_the_workers(pool):
    a = pool.submit(_sleep_then, 1, 0.0)
    b = pool.submit(_raise, "nope")
    c = pool.submit(_sleep_then, 3, 30.0, timeout_s=0.5)       # hangs: killed, replaced
    d = pool.submit(_sleep_then, 4, 30.0)                       # hangs: cancelled
    e = pool.submit(_sleep_then, 5, 0.3)
    assert pool.poll(0.0, [d]) == []
    restarts = pool.n_restarts
    out = {}
    while len(out) < 3:
        out.update({t: (s, p) for t, s, p in pool.poll(None, [a, b, c])})
    assert out[a] == ("ok", 2) and out[b] == ("error", "KeyError: 'nope'")
    assert out[c][0] == "timeout" and pool.n_restarts == restarts + 1
    assert pool.cancel(d) and not pool.cancel(d) and pool.n_restarts == restarts + 2
    # scoring runs while e is in flight, and e's outcome waits for poll
    scores, stats = pool.score([("4", "4"), ("5", "4")])
    assert scores.tolist() == [1.0, 0.0] and stats["n_error"] == 0
    assert pool.poll(None) == [(e, "ok", 10)] and pool.in_flight() == 0
    assert pool.poll(None) == []


def test_in_process_pool_submits_to_threads_with_timeouts():
    p = rewards.RewardPool("exact", num_workers=0, timeout_s=0.3)
    a, b, c = p.submit(_sleep_then, 1, 0.0), p.submit(_sleep_then, 2, 5.0), p.submit(_raise, "x")
    out = {}
    while len(out) < 3:
        out.update({t: (s, v) for t, s, v in p.poll(None)})
    assert out[a] == ("ok", 2) and out[b][0] == "timeout" and out[c][0] == "error"


def test_driver_in_workers_counts_errors_and_hangs_and_the_pool_recovers(pool):
    driver = envs.Driver("test_countdown", [{"n": 2}, {"n": 2}], TOK, pool=pool, timeout_s=1.0,
                         env_kwargs={"fail": True, "hang_s": 60.0})
    restarts = pool.n_restarts
    t0 = time.monotonic()
    tokens, masks = run_scheduler(driver, {(0, 0): ["hang"], (0, 1): ["a", "boom"],
                                           (1, 0): ["a", "b"], (1, 1): ["a", "hang"]})
    assert time.monotonic() - t0 < 20
    res = driver.results()
    assert [res[k].end for k in sorted(res)] == ["timeout", "error", "done", "timeout"]
    assert res[(1, 0)].turn_rewards == [0.5, 0.5] and res[(1, 0)].tool_s < 1.0
    assert res[(0, 1)].error == "ValueError: the environment broke"
    m = driver.metrics()
    assert (m["env/timeouts"], m["env/errors"], m["env/worker_restarts"]) == (2, 1, 2)
    assert pool.n_restarts == restarts + 2
    # the environment's state came back from the worker: (1, 0) counted down to done
    assert tokens[(1, 0)] == _ids("a") + [IM_END] + envs.observation_ids(
        TOK, [{"role": "user", "content": "1 left"}], last_token=IM_END) + _ids("b") + [IM_END]
    # a step that does not return a Step ends its trajectory; the pool goes on
    bad = envs.Driver("test_countdown", [{}], TOK, pool=pool, env_kwargs={"bad": True})
    run_scheduler(bad, {(0, 0): ["a"]})
    assert bad.results()[(0, 0)].error == "step returned a dict, not a Step"
    from lrl.envs.driver import _check_step
    assert "unreadable" in _check_step(Step(reward="x"))
    assert "reward nan" in _check_step(Step(reward=float("nan")))
    assert "unreadable" in _check_step(Step(info=[1]))


def test_driver_close_cancels_running_steps(pool):
    driver = envs.Driver("test_countdown", [{}], TOK, pool=pool, timeout_s=30.0,
                         env_kwargs={"hang_s": 60.0})
    driver.turn_ended((0, 0), np.array(_ids("hang") + [IM_END], np.int32), 100, False)
    deadline = time.monotonic() + 10
    while not any(w.state == "busy" for w in pool._workers) and time.monotonic() < deadline:
        assert driver.ready(block=False) == []     # each call moves the pool's queue on
    restarts = pool.n_restarts
    driver.close()
    assert pool.n_restarts == restarts + 1 and pool.in_flight() == 0
    assert driver.results()[(0, 0)].end == "length"


def test_observation_ids_with_the_embedded_tokenizer_match_a_full_render():
    """A real byte-level BPE tokenizer and lrl's embedded ChatML template (which keeps every
    turn as written, so its full render is a reference): the trajectory built turn by turn is
    the tokenisation of the whole conversation."""
    from lrl.data.synthetic import synthetic_corpus
    from lrl.data.tokenizer import build_tokenizer
    tok = build_tokenizer(synthetic_corpus(200), 300)
    eos = tok.eos_token_id
    convo = [{"role": "user", "content": "What is 12 * 34? Use the tool."}]
    ids = tok.apply_chat_template(convo, tokenize=True, add_generation_prompt=True)
    ids = list(getattr(ids, "input_ids", ids))
    for turn, obs in [("<think>long</think>calc 12 * 34", "408"), ("So 408.", None)]:
        ids += tok.encode(turn, add_special_tokens=False) + [eos]
        convo.append({"role": "assistant", "content": turn})
        if obs is not None:
            ids += envs.observation_ids(tok, [{"role": "tool", "content": obs}], last_token=eos,
                                        end_ids=[eos])
            convo.append({"role": "tool", "content": obs})
    full = tok.apply_chat_template(convo, tokenize=False)
    assert ids == tok.encode(full.rstrip("\n"), add_special_tokens=False)


def test_the_worked_example_guessing_game():
    from experiments.plugins import guess_env
    driver = envs.Driver("experiments.plugins.guess_env:Guess", [{"secret": 37}, {"seed": 3}],
                         TOK, max_turns=5)
    assert driver.first_observation(0).startswith("I am thinking of a whole number from 1 to 100")
    tokens, _ = run_scheduler(driver, {(0, 0): ["<think>99?</think>50", "I'll say 25", "37"],
                                       (0, 1): ["no idea", "37"]})
    res = driver.results()
    assert (res[(0, 0)].end, res[(0, 0)].turns, res[(0, 0)].reward) == ("done", 3, 0.9)
    assert res[(0, 1)].reward == pytest.approx(0.95)
    assert TOK.decode(tokens[(0, 0)]).count("<|im_start|>user\nlower<|im_end|>") == 1
    # bisection finds any secret in at most 7 guesses
    for row in guess_env.rows(20):
        env = envs.make(guess_env.Guess)
        env.reset(row)
        lo, hi = 1, 100
        for turn in range(7):
            step = env.step(str((lo + hi) // 2), None)
            if step.done:
                break
            lo, hi = ((lo + hi) // 2 + 1, hi) if step.observation == "higher" else \
                (lo, (lo + hi) // 2 - 1)
        assert step.done and step.reward == pytest.approx(1 - 0.05 * turn)


def test_tool_env_in_the_workers(pool):
    row = {"answer": "440040051", "reward": "exact", "meta": {"extract": "boxed"}}
    call = ('<tool_call>{"name": "calc", "arguments": {"expression": "48213 * 9127"}}'
            '</tool_call>')
    driver = envs.Driver("tools", [row], TOK, pool=pool, max_turns=3)
    tokens, masks = run_scheduler(driver, {(0, 0): [call, "\\boxed{440040051}"],
                                           (0, 1): [call, call, call]})
    res = driver.results()
    assert (res[(0, 0)].end, res[(0, 0)].reward, res[(0, 0)].tool_calls) == ("done", 1.0, 1)
    assert (res[(0, 1)].end, res[(0, 1)].tool_calls, res[(0, 1)].reward) == ("max_turns", 3, 0)
    assert "<tool_response>\n440040051\n</tool_response>" in TOK.decode(tokens[(0, 0)])


def test_loading_a_calls_module_in_the_worker_does_not_count_against_its_limit(pool):
    from tests import slow_import_helper
    ticket = pool.submit(slow_import_helper.double, 21, timeout_s=0.5)
    out = []
    while not out:
        out = pool.poll(None, [ticket])
    assert out == [(ticket, "ok", 42)]
