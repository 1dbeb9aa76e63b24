"""A tokenizer trained locally (byte-level BPE) and wrapped as a `transformers` tokenizer.

The default experiment must run with nothing downloaded, so its tokenizer is trained here with
the `tokenizers` library in a few seconds, then wrapped in `PreTrainedTokenizerFast` with a
Qwen-style ChatML chat template, so that the rest of lrl treats it exactly like the tokenizer
of a real Qwen checkpoint (`apply_chat_template`, `eos_token_id`, `save_pretrained`).

Fixed ids (the same for every vocabulary size):
  0 `<|pad|>` pad_token · 1 `<|endoftext|>` bos_token (document marker, unused by the
  template) · 2 `<|im_start|>` · 3 `<|im_end|>` eos_token (ends every chat turn, so it is
  the stop token of generation).
`<think>` and `</think>` are the last two ids (`vocab_size - 2`, `vocab_size - 1`): ordinary
added tokens, one id each and kept by `decode(skip_special_tokens=True)`, so a tiny model
emits the reasoning format in one step.

With `tools=True` (a task whose answers need a tool, `lrl.data.synthetic.TOOL_TASKS`) the
tool-call markup of Qwen2.5 / Qwen3 is one added token each, just before the think pair:
`<tool_call>` `</tool_call>` `<tool_response>` `</tool_response>` at `vocab_size - 6` ...
`vocab_size - 3`, and the chat template is `TOOL_TEMPLATE` (tool messages as Qwen renders
them; earlier turns' `<think>` blocks dropped, as DeepSeek-R1's and Qwen3's templates do,
which is why multi-turn rollouts must never re-render the history: `lrl.envs.render`).
Without it (the default task) the vocabulary, ids and template are unchanged.

Digits are split one per token (as Qwen2 does), so numbers of any size tokenize the same way
and arithmetic/retrieval answers are a fixed number of tokens per digit.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD, BOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SPECIAL_TOKENS = (PAD, BOS, IM_START, IM_END)
ADDED_TOKENS = (THINK_OPEN, THINK_CLOSE)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen2.5's template without tools and without its default system prompt (short prompts
# matter for tiny models); the rendered text is identical to Qwen's when a system message
# is given.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# CHAT_TEMPLATE plus Qwen2.5's tool messages (one user turn per tool message, its content in
# <tool_response> lines) and an assistant message's reasoning dropped from every turn but the
# last: re-rendering a conversation after a turn changes the earlier turns' tokens.
TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and not loop.last and '</think>' in "
    "message['content'] %}"
    "{{- '<|im_start|>assistant\\n' + message['content'].split('</think>')[-1].lstrip('\\n')"
    " + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: words with one leading non-letter, single digits, punctuation
# runs, newlines, spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _batches(texts: Iterable[str], size: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"build_tokenizer: training text #{i} is {type(text).__name__}, "
                            "expected str")
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def build_tokenizer(texts_or_iterator: Iterable[str], vocab_size: int,
                    out_dir: str | os.PathLike | None = None,
                    model_max_length: int = 1 << 20, tools: bool = False
                    ) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer on `texts_or_iterator` and wraps it for transformers.

    Deterministic for the same texts in the same order. `vocab_size` counts everything: the
    256 byte tokens, the 6 fixed tokens above and the learned merges. With `out_dir` the
    tokenizer is also written there with `save_pretrained` (reload with `load_tokenizer`).
    `tools`: the tool-call markup as added tokens and `TOOL_TEMPLATE` (module docstring).
    """
    added = (TOOL_TOKENS if tools else ()) + ADDED_TOKENS
    fixed = len(SPECIAL_TOKENS) + len(added)
    min_size = 256 + fixed
    if vocab_size < min_size:
        raise ValueError(f"build_tokenizer: vocab_size={vocab_size} is below {min_size} "
                         "(256 byte tokens + the special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0..3 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batches(texts_or_iterator), trainer=trainer)
    # Special tokens again so they are matched in raw text and skipped when decoding.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = TOOL_TEMPLATE if tools else CHAT_TEMPLATE
    _check_fixed_ids(hf_tok, vocab_size, added)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        hf_tok.save_pretrained(out_dir)
    return hf_tok


def _check_fixed_ids(tok: PreTrainedTokenizerFast, vocab_size: int, added: tuple) -> None:
    wanted = list(enumerate(SPECIAL_TOKENS))
    wanted += [(vocab_size - len(added) + i, t) for i, t in enumerate(added)]
    if len(tok) != vocab_size:
        raise RuntimeError(f"build_tokenizer: trained {len(tok)} tokens, expected {vocab_size} "
                           "(too little training text for this vocab_size?)")
    for want, token in wanted:
        got = tok.convert_tokens_to_ids(token)
        if got != want:  # the trainer or a library upgrade changed the order
            raise RuntimeError(f"build_tokenizer: {token!r} got id {got}, expected {want}")


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Loads a tokenizer saved by `build_tokenizer` or any local Hugging Face model directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_tokenizer: tokenizer directory {path!r} does not exist")
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        raise FileNotFoundError(f"load_tokenizer: {path!r} holds no tokenizer files "
                                f"(looked for {', '.join(names)})")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
