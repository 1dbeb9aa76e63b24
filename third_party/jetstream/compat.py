"""The smallest set of patches that lets the published JetStream run here, for
google-jetstream 0.2.2 (the newest on PyPI) on jax 0.10.2 (Python 3.11, where it runs in the
tests) and jax 0.11.2 (the GPU image: checked against its source, not run).

    from third_party.jetstream import compat
    compat.install()                       # before anything imports jetstream
    from jetstream.core import orchestrator

Patched: the `seqio` import (a stand-in), `jax.tree_map` in the orchestrator, the root logger
that importing the orchestrator takes over, the end of a request's return channel (a race
that killed the process), and the stop token a reply ends on, which 0.2.2 drops (kept for a
tokenizer that asks, `keep_stop_token`). `install()` is idempotent and patches only JetStream's own modules
(and adds a stand-in `seqio` module when the real one is absent); jax and the rest of the
process are left as they are. Each patch says why and for which upstream version.
`check_version()` refuses another google-jetstream version, whose code these patches were not
checked against.

Not patched, and so not supported: the IFRT proxy backend registration in
`jetstream/engine/__init__.py`, taken only with JAX_PLATFORMS naming "proxy" (it calls
`jax.lib.xla_bridge` and `jaxlib.xla_extension`, which jax 0.10 no longer has), and the
SentencePiece and tiktoken tokenizers of `jetstream.engine.token_utils` (seqio loads the
former through TensorFlow; lrl serves Hugging Face tokenizers, `third_party.jetstream.tokenizer`).
"""
from __future__ import annotations

import importlib.metadata
import logging
import sys
import types

import jax

UPSTREAM_VERSION = "0.2.2"
_installed = False


def check_version() -> str:
    try:
        version = importlib.metadata.version("google-jetstream")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("google-jetstream is not installed; see requirements-serve.txt for "
                          "the two-step install (the package itself with --no-deps)") from None
    if version != UPSTREAM_VERSION:
        raise ImportError(f"google-jetstream {version} is installed; third_party/jetstream's "
                          f"patches are for {UPSTREAM_VERSION} (pip install --no-deps "
                          f"google-jetstream=={UPSTREAM_VERSION})")
    return version


def _seqio_stand_in() -> None:
    """0.2.2: `jetstream.engine.token_utils` (imported by `engine_api`, so by everything)
    imports `seqio.vocabularies` at module level for its SentencePiece tokenizer, and
    `mock_utils` subclasses `seqio.vocabularies.Vocabulary`. seqio needs TensorFlow. The
    stand-in gives both names; building a SentencePiece vocabulary says what is missing."""
    try:
        import seqio  # noqa: F401  (a real seqio wins)
        return
    except ImportError:
        pass

    class Vocabulary:
        """Stand-in for seqio's base class (JetStream's mock vocabulary subclasses it)."""

    class SentencePieceVocabulary(Vocabulary):
        def __init__(self, *args, **kwargs):
            raise ImportError("JetStream's SentencePiece tokenizer needs seqio (and "
                              "TensorFlow), which lrl does not install; lrl engines serve "
                              "their Hugging Face tokenizer (third_party.jetstream.tokenizer)")

    stand_in = types.ModuleType("seqio")
    vocabularies = types.ModuleType("seqio.vocabularies")
    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    stand_in.vocabularies = vocabularies
    stand_in.__lrl_stand_in__ = True
    sys.modules["seqio"], sys.modules["seqio.vocabularies"] = stand_in, vocabularies


def _delete_pytree(p):
    """0.2.2's `orchestrator.delete_pytree` with `jax.tree.map` for `jax.tree_map`
    (deprecated in jax 0.4.26, absent from 0.10.2 and 0.11.2): the generate thread calls it
    after every insert, raised AttributeError, and JetStream's thread wrapper then SIGKILLs
    its own process."""
    def delete_leaf(leaf):
        if isinstance(leaf, jax.Array):
            leaf.delete()
    jax.tree.map(delete_leaf, p)


def _patch_multifuture() -> None:
    """0.2.2's `AsyncMultifuture` (a request's return channel) ends a stream with two
    callbacks onto the consumer's event loop: the end marker, then `_done.set`. A consumer
    whose loop closes once the stream has ended (`asyncio.run` around direct `Decode` calls)
    can close it between the two, and the detokenize thread's "Event loop is closed" then
    SIGKILLs the process (seen in this suite: 2 runs in 3). Here one callback does both, and
    a closed loop (its consumer gone, e.g. cancelled) is not an error: nobody is left to
    deliver to."""
    from jetstream.core.utils import async_multifuture as am

    def call(self, fn, *args):
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            if not self._loop.is_closed():
                raise

    def set_exception(self, exception: Exception) -> None:
        def finish():
            self._queue.put_nowait(am._Exception(exception))
            self._done.set()
        call(self, finish)

    def add_result(self, result) -> None:
        call(self, self._queue.put_nowait, result)

    am.AsyncMultifuture.set_exception = set_exception
    am.AsyncMultifuture.add_result = add_result


def _patch_stop_token() -> None:
    """0.2.2's detokenizer (`token_utils.process_result_tokens`) ends a sample on a stop token
    and drops it, so a client cannot tell which end token the model sampled (Llama 3 has
    several) and cannot continue the conversation with the model's exact tokens
    (`chat.py`). For a tokenizer whose `keep_stop_token` is true, the stop token is appended
    to the sample's `token_ids` (not to its text); lrl's servicer strips it again for
    clients that did not ask for it (`server.py`). Other tokenizers see no change."""
    from jetstream.engine import token_utils
    original = token_utils.process_result_tokens

    def process_result_tokens(tokenizer, slot, slot_max_length, result_tokens, complete,
                              is_client_side_tokenization=False, debug=False):
        # What the original will skip: samples already ended, or past max_tokens.
        data = result_tokens.get_result_at_slot(slot)
        skipped = complete | (data.lengths > slot_max_length)
        samples, complete = original(tokenizer, slot, slot_max_length, result_tokens,
                                     complete, is_client_side_tokenization, debug)
        if not getattr(tokenizer, "keep_stop_token", False):
            return samples, complete
        stops = tokenizer.stop_tokens
        for i, sample in enumerate(samples):
            if skipped[i].item():
                continue
            for tok, valid in zip(data.tokens[i].tolist(), data.valid[i].tolist()):
                if not valid:
                    break
                if tok in stops:
                    sample.token_ids.append(tok)
                    break
        return samples, complete

    token_utils.process_result_tokens = process_result_tokens


def install() -> None:
    global _installed
    if _installed:
        return
    check_version()
    _seqio_stand_in()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from jetstream.core import orchestrator
    # 0.2.2: importing the orchestrator sets the root logger to DEBUG and adds a stdout
    # handler, so every library's debug lines (and JetStream's line per decode step) print.
    # The process's own logging setup is put back; `serve` chooses the verbosity.
    root.setLevel(level)
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    orchestrator.delete_pytree = _delete_pytree
    _patch_multifuture()
    _patch_stop_token()
    _installed = True
