"""Multi-turn chat with tools against a policy served by `python -m lrl.serve`.

    python third_party/jetstream/chat.py --address=127.0.0.1:9000 --tokenizer=DIR \\
        --tools=lookup,calc --prompt="What is 12 * 34?" [--row='{"table": {"qz": "482"}}'] \\
        [--max_turns=4] [--max_tokens=256] [--max_prefill_length=1024] [--tool_timeout_s=10]

The conversation is held as token ids, never as text, exactly as a multi-turn rollout holds
a trajectory (lrl.envs.driver), so the served model sees the tokens the trainer would:
- the first request is the chat template's rendering of the system / user messages, with
  the tools' schemas (`tools=`; a template that does not list tools ignores them, as the
  training prompt is rendered), tokenized without added special tokens;
- after each reply, the tool calls in its text are parsed by lrl.envs' parser
  (`parse_tool_calls`, the tool environment's), the named registered tools run here
  (`lrl.envs.tools.call`, each under a time limit), and the history grows by the reply's
  own token ids, its end token included, plus the observation's ids
  (`lrl.envs.render.observation_ids`: one tool message per call, as `ToolEnv` answers);
- the whole history goes back as a JetStream `token_content` request.
A malformed call, a tool's error and a tool past its time limit are the model's observation
(text starting "error:"), never a crash.

The end token: JetStream drops the token a reply stops on, so the request carries the
metadata `lrl-stop-token: keep` and lrl's server returns it as the reply's last id (a reply
cut at max_tokens has none). Without it the history would lack the token the model sampled.

JetStream has no session: the server prefills the whole history again on every turn (no
prefix cache in 0.2.2), so a turn costs a prefill of everything so far, and the history must
fit the server's `--max_prefill_length` (less one position, JetStream's BOS). The chat stops
with an error naming that limit before it would send more.

The chat ends at a reply without a tool call ("answer"), after `--max_turns` replies
("max_turns"; the last reply's tools still run, as in the rollout, but nothing more is
sent), or at a reply cut at max_tokens ("max_tokens": the model's turn did not end; the
rollout runs no step for a cut turn either). Each turn is printed (the model's text, each
call and its observation), then one JSON line: turns, tool calls, tool errors, timeouts,
tokens, the end and any error.

A tool runs in a daemon thread: one past its limit is abandoned, not killed (its thread
may run on until the process exits; a tool stuck in C code holding the GIL would stall the
chat). The rollout kills worker processes instead (lrl.rewards.RewardPool).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

if __package__ in (None, ""):   # run as a script: lrl lives at the repository root
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from lrl.envs import tools as tool_registry  # noqa: E402
from lrl.envs.render import observation_ids  # noqa: E402
from lrl.envs.tool_env import FORMATS, parse_tool_calls  # noqa: E402

# server.STOP_TOKEN_METADATA (not imported: server.py pulls in jax and the engine).
STOP_TOKEN_METADATA = ("lrl-stop-token", "keep")

# ids, max_tokens -> the reply's ids, ending with the stop token when it stopped on one.
Send = Callable[[list, int], list]


class ChatError(RuntimeError):
    """The conversation cannot go on (a limit, the server's refusal)."""


@dataclasses.dataclass
class ToolRun:
    name: str
    arguments: object
    text: str          # the observation the model reads
    ok: bool
    timed_out: bool = False


@dataclasses.dataclass
class Turn:
    reply: list             # the reply's token ids, as sampled
    text: str
    calls: list             # ToolRun per parsed call
    observation: list       # ids appended after the reply ([] when the chat ended)


@dataclasses.dataclass
class Summary:
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    timeouts: int = 0
    prompt_tokens: int = 0
    reply_tokens: int = 0
    observation_tokens: int = 0
    tokens: int = 0          # the whole history
    end: str = ""
    error: Optional[str] = None


def run_tool(name: str, arguments, row: Optional[Mapping], allowed: Optional[Sequence[str]],
             timeout_s: float) -> ToolRun:
    """One registered tool under a time limit (see the module docstring on threads)."""
    box: list = []
    worker = threading.Thread(
        target=lambda: box.append(tool_registry.call(name, arguments, row, allowed)),
        name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not box:
        return ToolRun(name, arguments, f"error: {name} timed out after {timeout_s:g} s",
                       False, timed_out=True)
    text, ok = box[0]
    return ToolRun(name, arguments, text, ok)


def answer_calls(text: str, *, fmt: str, row: Optional[Mapping],
                 allowed: Optional[Sequence[str]], timeout_s: float,
                 max_calls: int) -> list[ToolRun]:
    """The reply's tool calls, each answered as `ToolEnv.step` answers it."""
    runs = []
    for i, call in enumerate(parse_tool_calls(text, fmt)):
        if call.error is not None:
            runs.append(ToolRun(call.name, call.arguments,
                                f"error: malformed tool call: {call.error}", False))
        elif i >= max_calls:
            runs.append(ToolRun(call.name, call.arguments,
                                f"error: more than {max_calls} tool calls in one turn", False))
        else:
            runs.append(run_tool(call.name, call.arguments, row, allowed, timeout_s))
    return runs


def prompt_ids(tokenizer, messages: Sequence[Mapping],
               tools: Optional[Sequence[str]]) -> list[int]:
    """The first request: the template's rendering with the assistant turn opened, as
    `lrl.data.prompts.tokenize_prompt` renders a training prompt (plus the tools' schemas)."""
    schemas = tool_registry.schemas(tools) if tools else None
    text = tokenizer.apply_chat_template(list(messages), tools=schemas, tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class Chat:
    """One conversation as token ids (see the module docstring).

    Args:
      tokenizer: the served policy's (`apply_chat_template`, `encode`, `decode`).
      send: sends the history, returns the reply's ids (`GrpcSend`, or a fake in tests).
      tools: the tools offered and allowed (default: every registered one).
      row: what row-reading tools get (e.g. {"table": {...}} for `lookup`).
      max_tokens: most tokens of one reply.
      max_prefill_length: the server's; the history must stay below it (None: the server's
        refusal, which names it, is the only check).
      end_ids: the model's end tokens (default: the tokenizer's eos), as the rollout's.
    """

    def __init__(self, tokenizer, send: Send, *, tools: Optional[Sequence[str]] = None,
                 row: Optional[Mapping] = None, fmt: str = "auto", max_tokens: int = 256,
                 max_prefill_length: Optional[int] = None, tool_timeout_s: float = 10.0,
                 end_ids: Sequence[int] = (), max_calls: int = 8):
        if fmt not in FORMATS:
            raise ValueError(f"Chat: fmt must be one of {FORMATS}, got {fmt!r}")
        if max_tokens < 1:
            raise ValueError(f"Chat: max_tokens must be >= 1, got {max_tokens}")
        self.tools = list(tools) if tools is not None else tool_registry.names()
        for name in self.tools:
            tool_registry.get(name)   # an unknown name fails here, listing the registered
        eos = getattr(tokenizer, "eos_token_id", None)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.end_ids = tuple(dict.fromkeys([*end_ids, *eos]))
        if not self.end_ids:
            raise ValueError("Chat: no end ids: the tokenizer has no eos_token; pass end_ids")
        self.tokenizer, self.send, self.row, self.fmt = tokenizer, send, dict(row or {}), fmt
        self.max_tokens, self.max_prefill_length = max_tokens, max_prefill_length
        self.tool_timeout_s, self.max_calls = tool_timeout_s, max_calls
        self.ids: list[int] = []
        self.summary = Summary()

    def begin(self, messages: Sequence[Mapping]) -> list[int]:
        self.ids = prompt_ids(self.tokenizer, messages, self.tools)
        self.summary = Summary(prompt_tokens=len(self.ids), tokens=len(self.ids))
        return self.ids

    def reply(self) -> list[int]:
        """Sends the history; -> the reply's ids, which the history now ends with."""
        self._check_room()
        reply = [int(t) for t in self.send(list(self.ids), self.max_tokens)]
        if len(reply) < self.max_tokens and (not reply or reply[-1] not in self.end_ids):
            last = reply[-1] if reply else None
            raise ChatError(
                f"the reply of {len(reply)} tokens (< max_tokens={self.max_tokens}) does not "
                f"end on an end token (its last id is {last}; end ids {list(self.end_ids)}): "
                "the server did not return the token it stopped on (serve with lrl.serve, "
                "which keeps it on request), or its end tokens differ (pass --end_ids)")
        self.ids += reply
        self.summary.turns += 1
        self.summary.reply_tokens += len(reply)
        self.summary.tokens = len(self.ids)
        return reply

    def observe(self, messages: Sequence[Mapping]) -> list[int]:
        """Appends `messages` (tool or user) and the next assistant header after the reply,
        as the rollout does; -> their ids."""
        ids = observation_ids(self.tokenizer, messages, last_token=self.ids[-1],
                              end_ids=self.end_ids)
        self.ids += ids
        self.summary.observation_tokens += len(ids)
        self.summary.tokens = len(self.ids)
        return ids

    def step(self, last: bool = False) -> Turn:
        """One model turn and its tools; the observation is appended unless the chat ends
        here (`summary.end` set)."""
        reply = self.reply()
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        if len(reply) == self.max_tokens and reply[-1] not in self.end_ids:
            self.summary.end = "max_tokens"
            return Turn(reply, text, [], [])
        runs = answer_calls(text, fmt=self.fmt, row=self.row, allowed=self.tools,
                            timeout_s=self.tool_timeout_s, max_calls=self.max_calls)
        self.summary.tool_calls += len(runs)
        self.summary.tool_errors += sum(not r.ok for r in runs)
        self.summary.timeouts += sum(r.timed_out for r in runs)
        if not runs or last:
            self.summary.end = "max_turns" if runs else "answer"
            return Turn(reply, text, runs, [])
        observation = self.observe([{"role": "tool", "content": r.text} for r in runs])
        return Turn(reply, text, runs, observation)

    def run(self, messages: Sequence[Mapping], max_turns: int = 4,
            on_turn: Callable[[int, Turn], None] = lambda i, t: None) -> Summary:
        """The whole chat; a `ChatError` is recorded in the summary and raised."""
        if max_turns < 1:
            raise ValueError(f"Chat: max_turns must be >= 1, got {max_turns}")
        self.begin(messages)
        try:
            for i in range(max_turns):
                turn = self.step(last=i == max_turns - 1)
                on_turn(i + 1, turn)
                if self.summary.end:
                    break
        except ChatError as e:
            self.summary.end, self.summary.error = "error", str(e)
            raise
        return self.summary

    def _check_room(self) -> None:
        limit = self.max_prefill_length
        if limit is not None and len(self.ids) + 1 > limit:
            raise ChatError(
                f"the conversation has {len(self.ids)} tokens after {self.summary.turns} "
                f"turn(s); the server's max_prefill_length={limit} takes at most {limit - 1} "
                "(one position is JetStream's BOS), and JetStream re-prefills the whole "
                "history each turn: serve with a larger --max_prefill_length, or end sooner")


class GrpcSend:
    """`send` over gRPC to an lrl.serve server: a `token_content` request asking for the
    stop token; a refusal (e.g. a limit) becomes a ChatError with the server's message."""

    def __init__(self, address: str, timeout_s: float = 600.0):
        import grpc
        from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
        self._grpc, self._pb, self.address, self.timeout_s = grpc, jetstream_pb2, address, timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = jetstream_pb2_grpc.OrchestratorStub(self._channel)

    def __call__(self, ids: list, max_tokens: int) -> list:
        request = self._pb.DecodeRequest(
            token_content=self._pb.DecodeRequest.TokenContent(token_ids=list(ids)),
            max_tokens=max_tokens)
        out: list[int] = []
        try:
            for response in self._stub.Decode(request, timeout=self.timeout_s,
                                              metadata=(STOP_TOKEN_METADATA,)):
                for sample in response.stream_content.samples:   # one per request
                    out.extend(sample.token_ids)
        except self._grpc.RpcError as e:
            raise ChatError(f"the server at {self.address} answered {e.code().name}: "
                            f"{e.details()}") from None
        return out

    def close(self) -> None:
        self._channel.close()


def print_turn(i: int, turn: Turn) -> None:
    print(f"[turn {i}] model: {turn.text}", flush=True)
    for r in turn.calls:
        args = json.dumps(r.arguments) if r.arguments is not None else "?"
        print(f"[turn {i}] tool call: {r.name or '?'}({args})", flush=True)
        print(f"[turn {i}] observation: {r.text}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", default="127.0.0.1:9000", help="HOST:PORT of the server")
    ap.add_argument("--tokenizer", required=True, help="the served policy's tokenizer dir")
    ap.add_argument("--prompt", required=True, help="the user message")
    ap.add_argument("--system", default=None, help="a system message before it")
    ap.add_argument("--tools", default=None,
                    help="comma-separated tools to offer (default: every registered one)")
    ap.add_argument("--tool_modules", default="",
                    help="comma-separated modules to import first (they register tools)")
    ap.add_argument("--row", default="{}", help='JSON the tools read, e.g. {"table": {...}}')
    ap.add_argument("--format", default="auto", choices=FORMATS, help="tool-call format")
    ap.add_argument("--max_turns", type=int, default=4, help="most model replies")
    ap.add_argument("--max_tokens", type=int, default=256, help="most tokens of one reply")
    ap.add_argument("--max_prefill_length", type=int, default=None,
                    help="the server's (default: the server's refusal says it)")
    ap.add_argument("--tool_timeout_s", type=float, default=10.0, help="limit of one call")
    ap.add_argument("--end_ids", default="",
                    help="comma-separated end ids (default: the tokenizer's eos)")
    args = ap.parse_args(argv)
    for module in filter(None, args.tool_modules.split(",")):
        importlib.import_module(module)
    from lrl.data.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(args.tokenizer)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    send = GrpcSend(args.address)
    try:
        chat = Chat(tokenizer, send,
                    tools=None if args.tools is None else
                    [t for t in args.tools.split(",") if t],
                    row=json.loads(args.row), fmt=args.format, max_tokens=args.max_tokens,
                    max_prefill_length=args.max_prefill_length,
                    tool_timeout_s=args.tool_timeout_s,
                    end_ids=[int(e) for e in args.end_ids.split(",") if e])
        try:
            chat.run(messages, args.max_turns, on_turn=print_turn)
        except ChatError as e:
            print(f"error: {e}", file=sys.stderr)
        print(json.dumps(dataclasses.asdict(chat.summary)), flush=True)
        return 1 if chat.summary.error else 0
    finally:
        send.close()


if __name__ == "__main__":
    sys.exit(main())
