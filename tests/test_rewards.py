"""Rewards: each reward on tricky inputs, the registry and weighted specs, and the worker pool
(timeouts and errors score 0 and are counted; a hung worker is replaced and the pool goes on).
"""
import logging
import os
import threading
import time

import ml_collections
import numpy as np
import pytest

import lrl.rewards as rewards
from lrl.data import synthetic as synth
from lrl.rewards.match import AMBIGUOUS, extract_choice
from lrl.rewards.math import last_boxed

# Test rewards, registered at import so that pool workers (which import this module by the
# name the registry records) find them too.
_RELEASE = threading.Event()  # lets the in-process "block" calls end after their test


@rewards.register("test_dispatch")
def _dispatch_reward(completion, answer, **meta):
    """Misbehaves on command, else defers to the math reward."""
    if completion == "spin":
        while True:  # CPU-bound and uninterruptible: only killing the process stops it
            pass
    if completion == "block":
        _RELEASE.wait(60)
        return 1.0
    if completion == "raise":
        raise RuntimeError("checker crashed")
    if completion == "exit":
        os._exit(3)
    if completion == "nan":
        return float("nan")
    return rewards.get("math")(completion, answer, **meta)


# ----- math ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} first, then \boxed{\{1,2\}}", r"\{1,2\}"),  # last box; escaped braces
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),  # nested braces
    (r"\boxed{a}\boxed{b{c}} end", "b{c}"),
    (r"\boxed 5.", "5"),  # no braces
    (r"\fbox{3}", "3"),
    (r"\boxed{3} then \boxed{\frac{1}{2", None),  # last box unclosed: truncated output
    ("no box at all", None),
    (r"\boxedx{3}", None),
    (r"\boxed{}", ""),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("boxed, answer", [
    ("0.5", r"\frac{1}{2}"), ("1/2", "0.5"), (r"\frac12", r"\dfrac{1}{2}"),
    ("3.0", "3"), ("x=3", "3"), ("3", r"$3$"), (r"\{2,1\}", r"\{1,2\}"), ("[1, 2)", "[1,2)"),
    ("50\\%", "0.5"), (r"\sqrt{18}", r"3\sqrt{2}"), ("(x+1)^2", "x^2+2x+1"),
    (r"\left( 1, 2 \right)", "(1,2)"), (r"\boxed{7}", "7"),
    (str(10**400), str(10**400)), ("10^{400}", str(10**400)),
    ("1e308", "10^{308}"), ("9" * 5000, "9" * 5000),  # over Python's int-from-str limit
    ("π", r"\pi"), ("日本", "日本"),
])
def test_math_equivalent_forms_score_one(boxed, answer):
    assert rewards.get("math")(f"Work... The answer is \\boxed{{{boxed}}}.", answer) == 1.0


@pytest.mark.parametrize("completion, answer", [
    (r"\boxed{3}", "4"), (r"\boxed{(1,2)}", "(1,2]"), (r"\boxed{0.333}", r"\frac{1}{3}"),
    (rf"\boxed{{{10**400 + 1}}}", str(10**400)), (r"\boxed{1e308}", "1e307"),
    ("the answer is 3", "3"),  # not boxed
    (r"\boxed{3", "3"), (r"\boxed{\frac{1}{2}", "0.5"),  # unbalanced
    (r"\boxed{}", "0"), (r"\boxed{}}}{{", "1"), ("", "1"), (r"\boxed{日本}", "中国"),
])
def test_math_wrong_or_malformed_scores_zero(completion, answer):
    assert rewards.get("math")(completion, answer) == 0.0


def test_math_fractional_timeout_and_numeric_answers():
    assert rewards.get("math")(r"\boxed{1/2}", "0.5", timeout_s=0.5) == 1.0
    assert rewards.get("math")(r"\boxed{1/2}", 0.5) == 1.0  # jsonl answers may be numbers
    assert rewards.get("math")(r"\boxed{1e308}", 1e308) == 1.0


def test_math_verify_hang_is_a_timeout_error_in_the_main_thread():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):  # sympy would evaluate 9^(9^(9^9)) forever
        rewards.get("math")(r"\boxed{9^{9^{9^{9}}}}", "5", timeout_s=1)
    assert time.monotonic() - t0 < 5


# ----- format, exact, regex, choice, synthetic ------------------------------------------------

@pytest.mark.parametrize("completion, kwargs, expected", [
    ("<think>add them</think>\n\\boxed{3}", {}, 1.0),
    ("  <think></think> 3 ", {}, 1.0),
    ("<think>x</think>", {}, 0.0),  # no answer
    ("<think>x</think>   \n", {}, 0.0),
    ("<think>x", {}, 0.0),  # unclosed
    ("answer <think>x</think> 3", {}, 0.0),  # text before the block
    ("<think>a</think><think>b</think>3", {}, 0.0),
    ("x</think>3", {}, 0.0),
    ("x</think>3", {"require_open": False}, 1.0),
    ("<think>x</think> 3", {"require_boxed": True}, 0.0),
    ("<think>x</think> \\boxed{3", {"require_boxed": True}, 0.0),
    ("<think>x</think> so \\boxed{3}", {"require_boxed": True}, 1.0),
    ("<think>ünïcode 🤔</think>答案", {}, 1.0),
])
def test_format(completion, kwargs, expected):
    assert rewards.get("format")(completion, "unused", **kwargs) == expected


def test_exact():
    exact = rewards.get("exact")
    assert exact("  Paris \n", "Paris") == 1.0
    assert exact("New   York", "New York") == 1.0
    assert exact("New   York", "New York", normalize_whitespace=False) == 0.0
    assert exact("paris", "Paris") == 0.0
    assert exact("PARIS", "Paris", ignore_case=True) == 1.0
    assert exact("Stra\u00dfe", "STRASSE", ignore_case=True) == 1.0  # casefold, not lower
    assert exact("Cafe\u0301", "Caf\u00e9") == 1.0  # decomposed vs composed accent
    assert exact(r"so \boxed{Paris}", "Paris", extract="boxed") == 1.0
    assert exact("reasoning\nParis\n\n", "Paris", extract="last_line") == 1.0
    assert exact("reasoning", "Paris", extract="boxed") == 0.0
    with pytest.raises(ValueError, match="extract"):
        exact("x", "x", extract="middle")


def test_regex():
    regex = rewards.get("regex")
    assert regex("The answer: 42.", "42", pattern=r"answer:\s*{answer}\b") == 1.0
    assert regex("The answer: 421.", "42", pattern=r"answer:\s*{answer}\b") == 0.0
    assert regex("value 3.5", "3.5", pattern=r"{answer}") == 1.0
    assert regex("value 305", "3.5", pattern=r"{answer}") == 0.0  # the answer is escaped
    assert regex("  abc  ", r"a.c") == 1.0  # no pattern: the answer is the pattern
    assert regex("xabc", r"a.c", mode="fullmatch") == 0.0
    assert regex(" ABC\n", r"a.c", mode="fullmatch", ignore_case=True) == 1.0
    with pytest.raises(ValueError, match="invalid pattern"):
        regex("x", "x", pattern="(")
    with pytest.raises(ValueError, match="mode"):
        regex("x", "x", mode="prefix")


@pytest.mark.parametrize("text, letter", [
    ("Answer: B", "B"), ("(B)", "B"), (r"\boxed{B}", "B"), ("so the answer is B.", "B"),
    ("The answer is (C), since ...", "C"), ("**Answer:** D", "D"), ("Answer: $\\text{D}$", "D"),
    ("The correct option is B.", "B"), (r"\boxed{\text{(B) Paris}}", "B"),
    ("Answer: A\nWait, no. The answer is C.", "C"),  # the last one written
    ("answer: A\n\\boxed{B}", "B"),
    ("(A) and (B) are wrong.\nSo (C).", "C"),
    ("Answer: B or C", AMBIGUOUS), (r"\boxed{A, C}", AMBIGUOUS), ("Answer: A/B", AMBIGUOUS),
    ("Answer: I think it is", None),  # "I" followed by a word is not option I
    ("I cannot tell.", None), ("", None),
])
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_choice_reward():
    choice = rewards.get("choice")
    assert choice("... the answer is (B).", "B") == 1.0
    assert choice("Answer: B", "(b)") == 1.0  # the gold answer's letter is normalised
    assert choice("Answer: B or C", "B") == 0.0  # hedging scores 0
    assert choice("Answer: E", "A", choices="ABCD") == 0.0
    with pytest.raises(ValueError, match="option letter"):
        choice("Answer: B", "Paris")


@pytest.mark.parametrize("task", ["kv_retrieval", "arithmetic"])
def test_synthetic_follows_the_data_format(task):
    reward = rewards.get("synthetic")
    for index in range(3):
        example = synth.make_example(task, seed=0, index=index)
        answer = example["answer"]
        assert reward(synth.sft_response(example), answer, task=task) == 1.0
        assert reward(synth.sft_response(example, think=False), answer) == 1.0
        assert reward(f"\\boxed{{ {answer} }}", answer) == 1.0
        assert reward(f"\\boxed{{{answer}}} no, \\boxed{{{int(answer) + 1}}}", answer) == 0.0
        assert reward(f"\\boxed{{0{answer}}}", answer) == 0.0
        assert reward(f"Answer: {answer}", answer) == 0.0  # the task asks for a box
        assert reward(f"\\boxed{{{answer}", answer) == 0.0


# ----- registry and combinations -------------------------------------------------------------

def test_unknown_reward_lists_the_registered_names():
    with pytest.raises(ValueError, match=r"unknown reward 'mathh'.*choice.*exact.*format.*math"):
        rewards.get("mathh")
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        rewards.combine([("math", 1.0), ("nope", 0.5)])
    assert {"math", "format", "exact", "regex", "choice", "synthetic"} <= set(rewards.names())


def test_register_refuses_a_different_function_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("math")(lambda c, a, **m: 0.0)
    with pytest.raises(ValueError, match="reward name"):
        rewards.register("a:b")


def test_combine_weights_and_spec_forms():
    right = "<think>1+2</think> \\boxed{3}"
    wrong_math = "<think>1+2</think> \\boxed{4}"
    bad_format = "\\boxed{3}"
    for spec in ([("math", 1.0), ("format", 0.1)], {"math": 1.0, "format": 0.1},
                 "math:1.0, format:0.1"):
        fn = rewards.combine(spec)
        assert fn(right, "3") == pytest.approx(1.1)
        assert fn(wrong_math, "3") == pytest.approx(0.1)
        assert fn(bad_format, "3") == pytest.approx(1.0)
    # Per-term kwargs are defaults that per-example meta overrides.
    fn = rewards.combine([("format", 0.5, {"require_boxed": True}), ("math", -1.0)])
    assert fn("<think>x</think> 3", "3") == 0.0
    assert fn("<think>x</think> 3", "3", require_boxed=False) == 0.5
    assert fn(right, "3") == pytest.approx(-0.5)
    # Specs as ml_collections configs hold them (ConfigDict is not a Mapping).
    cfg = ml_collections.ConfigDict({"terms": {"math": 1.0, "format": 0.1},
                                     "listed": [("format", 0.5, {"require_boxed": True})]})
    assert rewards.combine(cfg.terms)(right, "3") == pytest.approx(1.1)
    assert rewards.combine(cfg.listed)("<think>x</think> 3", "3") == 0.0
    for bad in ([], [("math",)], [("math", float("inf"))], ("math", 1.0), 3):
        with pytest.raises(ValueError):
            rewards.combine(bad)


# ----- the pool ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    # Never stops on failures: the tests using it make the workers fail on purpose.
    with rewards.RewardPool("test_dispatch", num_workers=2, timeout_s=1.5, fail_patience=0) as p:
        yield p


def test_pool_scores_in_order_and_counts_timeouts_and_errors(pool):
    items = [(r"\boxed{0.5}", r"\frac{1}{2}", {}),
             ("spin", "1", {}),                       # a hung checker: killed, replaced
             (r"\boxed{9^{9^{9^{9}}}}", "5", {}),     # math-verify itself hangs
             ("raise", "1", {}),
             ("nan", "1", {}),                        # a non-finite reward is an error
             ("exit", "1", {}),                       # the worker dies mid-call
             (r"\boxed{3}", "4", {}),
             (r"\boxed{x=3}", "3")]                   # meta is optional
    t0 = time.monotonic()
    scores, stats = pool.score(items)
    assert time.monotonic() - t0 < 20
    np.testing.assert_array_equal(scores, [1, 0, 0, 0, 0, 0, 0, 1])
    assert scores.dtype == np.float32
    assert (stats["n_items"], stats["n_timeout"], stats["n_error"]) == (8, 2, 3)
    assert stats["n_restarts"] == 3  # two timeouts and one death
    assert stats["term_mean/test_dispatch"] == pytest.approx(2 / 3)

    # The pool works on afterwards, with no false timeouts, and keeps the order.
    answers = [str(i) for i in range(24)]
    items = [(f"\\boxed{{{a if i % 3 else int(a) + 1}}}", a, {}) for i, a in enumerate(answers)]
    scores, stats = pool.score(items)
    np.testing.assert_array_equal(scores, [float(i % 3 != 0) for i in range(24)])
    assert (stats["n_timeout"], stats["n_error"], stats["n_restarts"]) == (0, 0, 0)
    assert pool.score([])[0].shape == (0,)


def test_a_dead_worker_is_reported_with_its_exit_code(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="lrl.rewards.pool"):
        scores, stats = pool.score([("exit", "1", {})])
    assert scores.tolist() == [0.0] and stats["n_error"] == 1
    # The code was read before the process was joined, so it said "exit code None".
    assert "worker died, exit code 3" in caplog.text


def test_pool_with_a_weighted_spec_reports_each_term():
    with rewards.RewardPool([("math", 1.0), ("format", 0.5)], num_workers=1, timeout_s=5) as p:
        scores, stats = p.score([("<think>a</think>\\boxed{3}", "3", {}),
                                 ("\\boxed{3}", "3", {}), ("<think>a</think>x", "3", {})])
    np.testing.assert_allclose(scores, [1.5, 1.0, 0.5])
    assert stats["term_mean/math"] == pytest.approx(2 / 3)
    assert stats["term_mean/format"] == pytest.approx(2 / 3)


def test_in_process_pool_times_out_in_a_thread_and_counts():
    p = rewards.RewardPool("test_dispatch", num_workers=0, timeout_s=1.0)
    try:
        # Math in a non-main thread must not trip math-verify's SIGALRM timeout.
        scores, stats = p.score([(r"\boxed{1/2}", "0.5", {}), ("block", "1", {}),
                                 ("raise", "1", {}), (r"\boxed{2}", "3", {})])
    finally:
        _RELEASE.set()
    np.testing.assert_array_equal(scores, [1, 0, 0, 0])
    assert (stats["n_timeout"], stats["n_error"]) == (1, 1)
    no_limit = rewards.RewardPool("math", num_workers=0, timeout_s=None)
    assert no_limit.score([(r"\boxed{3}", "3.0", {})])[0].tolist() == [1.0]


def test_a_reward_failing_every_call_stops_the_run_after_patience_calls(caplog):
    bad = [("raise", "1", {})] * 4
    p = rewards.RewardPool("test_dispatch", num_workers=0, timeout_s=None)  # defaults: 1.0, 3
    assert (p.fail_frac, p.fail_patience) == (1.0, 3)
    for _ in range(2):  # it used to warn and score 0 forever
        assert p.score(bad)[0].tolist() == [0.0] * 4
    p.score([(r"\boxed{1}", "1", {})] + bad)  # one item scored: the count starts over
    p.score(bad)
    p.score(bad)
    with pytest.raises(rewards.RewardFailure, match=r"'test_dispatch'.*every item of 3 scoring "
                       r"calls in a row.*reward.fail_frac=1.0.*first error: item 0: error: "
                       r"RuntimeError: checker crashed"):
        p.score(bad)
    # A fraction below 1 counts a call with that share of failures; patience 0 never stops.
    half = [(r"\boxed{1}", "1", {})] * 2 + bad[:2]
    p = rewards.RewardPool("test_dispatch", num_workers=0, timeout_s=None, fail_frac=0.5,
                           fail_patience=2)
    p.score(half)
    with pytest.raises(rewards.RewardFailure, match=r"at least 50% of the items of 2 scoring"):
        p.score(half)
    p = rewards.RewardPool("test_dispatch", num_workers=0, timeout_s=None, fail_patience=0)
    for _ in range(5):
        p.score(bad)
    with pytest.raises(ValueError, match="fail_frac"):
        rewards.RewardPool("math", num_workers=0, fail_frac=0.0)


def test_worker_pool_stops_too_and_the_configs_set_the_limits():
    from lrl import build, config_util
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("default.py", "video_synthetic.py"):
        cfg = config_util.load(os.path.join(root, "configs", name))
        cfg.reward.update(spec="test_dispatch:1.0", num_workers=1, fail_patience=1)
        with build.reward_pool(build.options(cfg, check_files=False)) as p:
            assert (p.fail_frac, p.fail_patience) == (cfg.reward.fail_frac, 1)
            with pytest.raises(rewards.RewardFailure, match="worker died, exit code 3"):
                p.score([("exit", "1", {})])


def test_pool_rejects_bad_arguments():
    with pytest.raises(ValueError, match="not a registered reward"):
        rewards.RewardPool(lambda c, a, **m: 1.0, num_workers=0)
    with pytest.raises(ValueError, match="fork is unsafe"):
        rewards.RewardPool("math", mp_context="fork")
    with pytest.raises(ValueError, match="item 0: meta must be a mapping"):
        rewards.RewardPool("math", num_workers=0).score([("a", "1", ["x"])])
    with pytest.raises(ValueError, match="item 1: completion must be a str"):
        rewards.RewardPool("math", num_workers=0).score([("a", "1"), (None, "1")])
