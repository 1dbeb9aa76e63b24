"""Multi-turn chat with tools through the served policy (third_party/jetstream/chat.py).

Against a fake server (scripted reply ids): the history sent on each turn is exactly the
previous history + the reply's ids + the observation's ids, tools run with the parsed
arguments, a malformed call, a hanging tool and a missing stop token are handled, and the
prefill limit stops the chat with an error naming it. Through a real gRPC server with a tiny
random model (which never calls a tool): each turn's reply ids, the stop token included,
are `lrl.rollout.generate`'s greedy tokens for the same history, over two turns.
"""
import json
import threading

import jax
import numpy as np
import pytest

pytest.importorskip("jetstream", reason="google-jetstream is not installed "
                                        "(requirements-serve.txt)")
pytest.importorskip("grpc")

import lrl.models as models  # noqa: E402
import lrl.rollout as rollout  # noqa: E402
from lrl.data.synthetic import synthetic_corpus  # noqa: E402
from lrl.data.tokenizer import build_tokenizer  # noqa: E402
from lrl.envs import observation_ids, tool  # noqa: E402
from third_party.jetstream import chat, server  # noqa: E402
from third_party.jetstream.engine import LrlEngine  # noqa: E402
from third_party.jetstream.tokenizer import HFTokenizer  # noqa: E402

MAX_NEW = 8
SIZES = dict(max_prefill_length=64, max_new_tokens=MAX_NEW, max_slots=2, page_size=4,
             prefill_block_pages=2, decode_block_pages=2)
USER = [{"role": "user", "content": "Look up key qz."}]
TABLE = {"table": {"qz": "482"}}
SEEN: list = []          # what the `echo` tool was called with
RELEASE = threading.Event()


@tool("echo", "Returns its arguments (a test tool).",
      {"key": {"type": "string"}, "n": {"type": "integer"}})
def echo(key: str, n: int) -> str:
    SEEN.append({"key": key, "n": n})
    return f"{key}*{n}"


@tool("hang", "Never returns in time (a test tool).", {})
def hang() -> str:
    RELEASE.wait(30)
    return "late"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(synthetic_corpus(200), 300, tools=True)


def enc(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def call_ids(tok, text):
    """A scripted reply: `text` and the end token."""
    return enc(tok, text) + [tok.eos_token_id]


class FakeServer:
    """`send` without gRPC: records each history, answers the scripted replies in order."""

    def __init__(self, replies):
        self.replies, self.sent = list(replies), []

    def __call__(self, ids, max_tokens):
        self.sent.append(list(ids))
        return self.replies.pop(0)


def test_history_is_reply_and_observation_ids_exactly(tok):
    from lrl.data.prompts import tokenize_prompt
    SEEN.clear()
    r1 = call_ids(tok, '<tool_call>{"name": "lookup", "arguments": {"key": "qz"}}</tool_call>'
                       '<tool_call>{"name": "echo", "arguments": {"key": "a b", "n": 3}}'
                       '</tool_call>')
    r2 = call_ids(tok, "It is \\boxed{482}.")
    fake = FakeServer([r1, r2])
    c = chat.Chat(tok, fake, tools=["lookup", "echo"], row=TABLE, max_tokens=64)
    turns = []
    summary = c.run(USER, max_turns=4, on_turn=lambda i, t: turns.append(t))

    # The first request is the training prompt (this template lists no tools).
    np.testing.assert_array_equal(fake.sent[0], tokenize_prompt(tok, USER))
    obs = observation_ids(tok, [{"role": "tool", "content": "482"},
                                {"role": "tool", "content": "a b*3"}],
                          last_token=tok.eos_token_id, end_ids=(tok.eos_token_id,))
    assert fake.sent[1] == fake.sent[0] + r1 + obs
    assert c.ids == fake.sent[1] + r2
    assert SEEN == [{"key": "a b", "n": 3}]
    assert [(r.name, r.arguments, r.text, r.ok) for r in turns[0].calls] == [
        ("lookup", {"key": "qz"}, "482", True), ("echo", {"key": "a b", "n": 3}, "a b*3", True)]
    assert turns[0].observation == obs and turns[1].calls == [] and turns[1].observation == []
    assert (summary.turns, summary.tool_calls, summary.tool_errors, summary.end) == (
        2, 2, 0, "answer")
    assert (summary.prompt_tokens, summary.reply_tokens, summary.observation_tokens,
            summary.tokens) == (len(fake.sent[0]), len(r1) + len(r2), len(obs), len(c.ids))


def test_malformed_call_unknown_tool_and_hanging_tool_are_observations(tok):
    r1 = call_ids(tok, '<tool_call>{"name": "lookup", "arguments": {"key": </tool_call>'
                       '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                       '<tool_call>{"name": "hang", "arguments": {}}</tool_call>')
    fake = FakeServer([r1, call_ids(tok, "done")])
    c = chat.Chat(tok, fake, tools=["lookup", "hang"], row=TABLE, tool_timeout_s=0.2)
    turns = []
    try:
        summary = c.run(USER, on_turn=lambda i, t: turns.append(t))
    finally:
        RELEASE.set()
    texts = [r.text for r in turns[0].calls]
    assert texts[0].startswith("error: malformed tool call: the tool call is not valid JSON")
    assert texts[1].startswith("error: unknown tool 'nope'; available: lookup, hang")
    assert texts[2] == "error: hang timed out after 0.2 s"
    obs = observation_ids(tok, [{"role": "tool", "content": t} for t in texts],
                          last_token=tok.eos_token_id, end_ids=(tok.eos_token_id,))
    assert fake.sent[1] == fake.sent[0] + r1 + obs
    assert (summary.tool_calls, summary.tool_errors, summary.timeouts, summary.end) == (
        3, 3, 1, "answer")


def test_prefill_limit_max_turns_cut_reply_and_missing_stop_token(tok):
    r1 = call_ids(tok, '<tool_call>{"name": "lookup", "arguments": {"key": "qz"}}</tool_call>')
    prompt = chat.prompt_ids(tok, USER, ["lookup"])
    # Room for the prompt and the reply, not for the observation after it.
    limit = len(prompt) + len(r1) + 2
    fake = FakeServer([r1])
    c = chat.Chat(tok, fake, tools=["lookup"], row=TABLE, max_prefill_length=limit)
    with pytest.raises(chat.ChatError, match=f"max_prefill_length={limit} takes at most "
                                             f"{limit - 1}"):
        c.run(USER)
    assert len(fake.sent) == 1 and (c.summary.turns, c.summary.end) == (1, "error")
    assert f"max_prefill_length={limit}" in c.summary.error

    fake = FakeServer([r1, r1])   # always a call: the turns run out
    summary = chat.Chat(tok, fake, tools=["lookup"], row=TABLE).run(USER, max_turns=2)
    assert (summary.turns, summary.tool_calls, summary.end) == (2, 2, "max_turns")
    assert len(fake.sent) == 2

    cut = enc(tok, '<tool_call>{"name": "lookup"')   # the turn did not end: no tool runs
    summary = chat.Chat(tok, FakeServer([cut]), max_tokens=len(cut)).run(USER)
    assert (summary.turns, summary.tool_calls, summary.end) == (1, 0, "max_tokens")

    short = enc(tok, "no end token")   # a server that dropped the stop token
    with pytest.raises(chat.ChatError, match="did not return the token it stopped on"):
        chat.Chat(tok, FakeServer([short]), max_tokens=64).run(USER)
    with pytest.raises(KeyError, match="unknown tool 'nope'"):
        chat.Chat(tok, FakeServer([]), tools=["nope"])
    assert chat.STOP_TOKEN_METADATA == server.STOP_TOKEN_METADATA


def _upto(tokens, eos, max_tokens):
    """What the server returns with the stop token kept: at most max_tokens, through eos."""
    out = tokens[:max_tokens]
    return out[:out.index(eos) + 1] if eos in out else out


def test_two_turns_through_the_server_are_generates_tokens(tok, tmp_path, capsys):
    cfg = models.ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=8, mlp_dim=64, remat="none")
    params = models.init_params(cfg, jax.random.key(0))

    def greedy(ids, eos=()):
        out = rollout.generate(cfg, params, [np.asarray(ids, np.int32)],
                               max_new_tokens=MAX_NEW, eos_ids=eos, page_size=4)
        return [int(t) for t in out[0][0][0]]

    first = chat.prompt_ids(tok, USER, ["lookup"])
    free = greedy(first)
    # An end token the first reply reaches at its third token (so the stop token comes back).
    eos = free[2] if free[2] not in free[:2] else next(t for t in range(4, 300) if t not in free)
    srv = server.start(LrlEngine(cfg, params, HFTokenizer(tok, (eos,)), **SIZES),
                       "127.0.0.1", 0)
    send = chat.GrpcSend(srv.address)
    try:
        c = chat.Chat(tok, send, tools=["lookup"], row=TABLE, max_tokens=6, end_ids=(eos,),
                      max_prefill_length=SIZES["max_prefill_length"])
        c.begin(USER)
        history = list(c.ids)
        reply = c.reply()
        # An end token only ends generation: the tokens before it are free's.
        assert history == first and reply == _upto(free, eos, 6)
        assert (reply[-1] == eos) == (eos in free[:6])
        c.observe([{"role": "user", "content": "Again?"}])
        history = list(c.ids)
        assert history[:len(first) + len(reply)] == first + reply
        assert c.reply() == _upto(greedy(history, (eos,)), eos, 6)
        with pytest.raises(chat.ChatError, match="INVALID_ARGUMENT.*max_prefill_length=64"):
            send([5] * 70, 4)

        tok.save_pretrained(str(tmp_path / "tok"))
        rc = chat.main([f"--address={srv.address}", f"--tokenizer={tmp_path / 'tok'}",
                        f"--prompt={USER[0]['content']}", "--tools=lookup",
                        f"--row={json.dumps(TABLE)}", "--max_tokens=6", "--max_turns=2",
                        f"--end_ids={eos}", "--max_prefill_length=64"])
        out = capsys.readouterr().out
        summary = json.loads(out.splitlines()[-1])
        assert out.startswith("[turn 1] model: " + tok.decode(_upto(free, eos, 6),
                                                              skip_special_tokens=True))
        assert rc == 0 and summary["error"] is None and summary["turns"] >= 1
        assert summary["prompt_tokens"] == len(first)
    finally:
        send.close()
        srv.stop()
