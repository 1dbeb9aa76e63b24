"""JetStream's orchestrator (its `Driver` and `LLMOrchestrator`) and gRPC server over one
`LrlEngine`, on one host.

    server = start(engine, host="127.0.0.1", port=9000)   # port 0: any free port
    print(server.address); ...; server.stop()

The driver runs in JetStream's interleaved mode (one engine prefills and generates). Two
things are ours, in `Orchestrator`, a subclass of JetStream's servicer:
- A request the engine cannot serve (a prompt past `max_prefill_length`, max_tokens past
  `max_new_tokens` or unset, ids outside the vocabulary) is refused before it is queued,
  with INVALID_ARGUMENT and a message that names the limit. (JetStream itself would cut the
  prompt to its last tokens with a log warning.)
- Streamed text is decoded from the reply's token ids so far (`tokenizer.StreamText`), not
  token by token, so characters split over byte-level tokens come out whole.
- A client that sends the metadata `lrl-stop-token: keep` (`STOP_TOKEN_METADATA`) gets the
  end token the reply stopped on as the last of its token ids (JetStream drops it; a reply
  cut at max_tokens has none). A multi-turn client needs it to continue the conversation
  with the model's exact tokens (`chat.py`). Others get JetStream's replies unchanged.
JetStream's own server (`jetstream.core.server_lib`) is not used: it listens on every
interface ("[::]") and builds its servicer itself; this one listens on `host` only.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Optional

import grpc

from third_party.jetstream import compat
from third_party.jetstream.engine import LrlEngine
from third_party.jetstream.tokenizer import StreamText

compat.install()
from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

log = logging.getLogger("lrl.serve")
STOP_TOKEN_METADATA = ("lrl-stop-token", "keep")


def make_driver(engine: LrlEngine) -> orchestrator.Driver:
    params = engine.load_params()
    # Padding on the host: prefill reads the tokens back to the host anyway.
    return orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True, jax_padding=False)


class Orchestrator(orchestrator.LLMOrchestrator):
    def __init__(self, driver: orchestrator.Driver, engine: LrlEngine):
        super().__init__(driver=driver)
        self._engine = engine
        engine.tokenizer.keep_stop_token = True   # stripped below unless the client asks

    def request_error(self, request: jetstream_pb2.DecodeRequest) -> Optional[str]:
        if request.WhichOneof("content") == "token_content":
            ids = list(request.token_content.token_ids)
            vocab = self._engine.cfg.vocab_size
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                return f"token ids outside [0, {vocab}): {bad[:8]}"
        else:
            ids = self._engine.tokenizer.prompt_ids(request.text_content.text)
        if len(ids) == 0:
            return "the prompt is empty"
        bos = 0 if request.session_cache else 1   # JetStream's BOS position (its is_bos)
        return self._engine.request_error(len(ids) + bos, request.max_tokens)

    async def Decode(self, request, context=None):  # noqa: N802 (gRPC's name)
        error = self.request_error(request)
        if error:
            log.warning("request refused: %s", error)
            if context is None:
                raise ValueError(error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        text = request.WhichOneof("content") != "token_content"
        keep = context is not None and any(
            (m.key, m.value) == STOP_TOKEN_METADATA for m in context.invocation_metadata() or ())
        stops = self._engine.tokenizer.stop_tokens
        stream = [StreamText(self._engine.tokenizer)]
        async for response in super().Decode(request, context):
            for i, sample in enumerate(response.stream_content.samples):
                # Only the stop-token patch puts a stop token in a sample, and only last.
                ids = list(sample.token_ids)
                stop = ids[-1:] if ids and ids[-1] in stops else []
                if stop and not keep:
                    del sample.token_ids[-1]
                if text:
                    sample.text = stream[i].add(ids[:len(ids) - len(stop)])
            yield response
        rest = [s.flush() for s in stream] if text else []
        if any(rest):   # the reply ended inside a character: its bytes, as U+FFFD
            Sample = jetstream_pb2.DecodeResponse.StreamContent.Sample  # noqa: N806
            yield jetstream_pb2.DecodeResponse(
                stream_content=jetstream_pb2.DecodeResponse.StreamContent(
                    samples=[Sample(text=r) for r in rest]))


class Server:
    """The gRPC server on its own event loop thread, and the driver it feeds."""

    def __init__(self, engine: LrlEngine, host: str, port: int, threads: int):
        self.driver = make_driver(engine)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop",
                                        daemon=True)
        self._thread.start()

        async def build():
            server = grpc.aio.server(self._executor)
            jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
                Orchestrator(self.driver, engine), server)
            bound = server.add_insecure_port(f"{host}:{port}")
            if not bound:
                raise OSError(f"cannot listen on {host}:{port}")
            await server.start()
            return server, bound

        try:
            self._grpc, bound = self._run(build())
        except Exception:
            self.driver.stop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self.address = f"{host}:{bound}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def wait(self) -> None:
        self._run(self._grpc.wait_for_termination())

    def stop(self, grace: float = 5.0) -> None:
        self._run(self._grpc.stop(grace))
        self.driver.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._executor.shutdown(wait=False)


def start(engine: LrlEngine, host: str = "127.0.0.1", port: int = 9000,
          threads: Optional[int] = None) -> Server:
    """Starts the driver's threads and the gRPC server; returns once it listens.
    `threads` (gRPC workers) defaults to JetStream's choice: the slots, at least 64."""
    return Server(engine, host, port, threads or max(engine.max_concurrent_decodes, 64))
