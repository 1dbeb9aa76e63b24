"""A Hugging Face tokenizer (the one an lrl run trained with) as JetStream's Tokenizer.

Prompts are rendered as in training: a text request is one user message put through the
tokenizer's chat template with the assistant turn opened, tokenized without added special
tokens (`lrl.data.prompts.tokenize_prompt`, not imported: that module pulls in grain, which
the accelerator image lacks). With `chat_template=False` the text is tokenized as it is.

JetStream's BOS: its orchestrator gives the first position of every fresh request to
`bos_id` (prepended to token requests by `token_utils.pad_tokens`, asked of `encode` for text
ones). lrl prompts carry their own BOS, if any, from the chat template, so this tokenizer
reports `BOS_MARK` (-1, never a token) there and `LrlEngine.prefill` drops it; a prompt then
has at most `max_prefill_length - 1` tokens.

The stop tokens are the model's end tokens only: JetStream's default adds `pad_id`, which a
model may emit as an ordinary token.

Every call holds one lock: JetStream's prefill, detokenize and gRPC threads share this
object, and a fast tokenizer that is used from two threads while one of them changes its
padding or truncation settings fails with "Already borrowed".
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from third_party.jetstream import compat

compat.install()
from jetstream.engine import token_utils, tokenizer_api  # noqa: E402

BOS_MARK = -1


class HFTokenizer(tokenizer_api.Tokenizer):
    # Whether JetStream's detokenizer appends the stop token a reply ended on to its token ids
    # (compat._patch_stop_token); lrl's servicer turns it on and strips it for other clients.
    keep_stop_token = False

    def __init__(self, tokenizer, eos_ids: Sequence[int], chat_template: bool = True):
        eos_ids = tuple(int(e) for e in eos_ids)
        if not eos_ids:
            raise ValueError("HFTokenizer: no end tokens: the model config names none and the "
                             "tokenizer has no eos_token; pass eos_ids")
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
                             "chat_template; serve raw text (chat_template=False, "
                             "--raw_text) instead")
        self.hf = tokenizer
        self.eos_ids = eos_ids
        self.chat_template = chat_template
        self._lock = threading.Lock()

    def prompt_ids(self, text: str) -> np.ndarray:
        """The prompt's token ids (int32), as an lrl run renders a one-message prompt."""
        with self._lock:
            if self.chat_template:
                text = self.hf.apply_chat_template([{"role": "user", "content": text}],
                                                   tokenize=False, add_generation_prompt=True)
            return np.asarray(self.hf(text, add_special_tokens=False)["input_ids"], np.int32)

    def encode(self, s: str, **kwargs):
        """-> (padded ids, true length), padded as JetStream pads token requests: to the next
        of its power-of-two lengths, at most `max_prefill_length`."""
        ids = self.prompt_ids(s)
        return token_utils.pad_tokens(
            ids, self.bos_id, self.pad_id, is_bos=kwargs.get("is_bos", True),
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", True))

    def decode(self, token_ids: list[int], **kwargs) -> str:
        with self._lock:
            return self.hf.decode(list(token_ids), skip_special_tokens=True)

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return 0 if pad is None else int(pad)

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def bos_id(self) -> int:
        return BOS_MARK

    @property
    def stop_tokens(self) -> set[int]:
        return set(self.eos_ids)


class StreamText:
    """Turns a growing list of token ids into text pieces, holding back the end of an
    unfinished UTF-8 character. JetStream decodes each token alone, so a character split
    over two byte-level BPE tokens comes out as two U+FFFD; this decodes the whole reply so
    far (and keeps it exact for tokenizers whose pieces depend on their neighbours)."""

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def flush(self) -> str:
        """What is held back when the reply ends (replacement characters, if it ended
        inside a character)."""
        text = self.tokenizer.decode(self.ids)
        piece, self.sent = text[len(self.sent):], text
        return piece
