"""Tokenizer, synthetic tasks, file sources and the grain prompt / SFT pipelines (CPU)."""
import json
import logging
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lrl.data import prompts, sources, synthetic, tokenizer


@pytest.fixture(scope="module")
def tok():
    return tokenizer.build_tokenizer(synthetic.synthetic_corpus(300, seed=1), vocab_size=512)


# ---------------------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip_special_ids_and_chat_template(tok, tmp_path):
    text = "Compute 12 + 345. naïve ∑ emoji 🙂 \\boxed{7}\n\ttabs"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(tok) == 512
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 3)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 2
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [510, 511]
    # Digits are one token each, so every number tokenizes the same way.
    assert tok.tokenize("4821") == ["4", "8", "2", "1"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    enc = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert list(enc["input_ids"]) == tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(enc["input_ids"][:1]) == ["<|im_start|>"]
    # The think tokens survive skip_special_tokens, the chat markers do not.
    resp = tok("<think>a: 1</think>\n\\boxed{1}<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(resp, skip_special_tokens=True) == "<think>a: 1</think>\n\\boxed{1}"

    out = tmp_path / "tok"
    tokenizer.build_tokenizer(synthetic.synthetic_corpus(300, seed=1), 512, out_dir=out)
    loaded = tokenizer.load_tokenizer(out)
    assert loaded.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()  # deterministic
    assert loaded.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=True) == rendered
    assert loaded.eos_token_id == 3 and loaded.pad_token_id == 0


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        tokenizer.load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        tokenizer.load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="vocab_size=100"):
        tokenizer.build_tokenizer(["abc"], 100)


# ---------------------------------------------------------------------------- synthetic

def test_kv_retrieval_is_deterministic_and_answer_is_in_the_pairs():
    kw = dict(num_pairs=40, min_pairs=5, key_len=3, value_len=5)
    counts = set()
    for i in range(50):
        ex = synthetic.make_example("kv_retrieval", 7, i, **kw)
        assert ex == synthetic.make_example("kv_retrieval", 7, i, **kw)
        pairs = re.findall(r"^([a-z]{3}): (\d{5})$", ex["prompt"], re.M)
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)) == ex["metadata"]["num_pairs"]
        counts.add(len(keys))
        query = re.search(r"value of key ([a-z]+)\?", ex["prompt"]).group(1)
        assert dict(pairs)[query] == ex["answer"] and ex["answer"][0] != "0"
        assert ex["messages"] == [{"role": "user", "content": ex["prompt"]}]
        assert ex["task"] == "kv_retrieval"
    assert len(counts) > 5 and min(counts) >= 5 and max(counts) <= 40
    a, b = (synthetic.make_example("kv_retrieval", s, 3, **kw) for s in (7, 8))
    assert a["prompt"] != b["prompt"]


def test_arithmetic_answer_and_sft_format():
    for i in range(50):
        ex = synthetic.sft_example("arithmetic", 0, i, num_terms=6, min_terms=2, max_operand=20)
        expr = re.search(r"Compute (.*)\. Answer", ex["prompt"]).group(1)
        assert str(eval(expr)) == ex["answer"] and int(ex["answer"]) >= 0  # noqa: S307
        m = re.fullmatch(r"<think>(.*)</think>\n\\boxed\{(\d+)\}", ex["response"], re.S)
        assert m and m.group(2) == ex["answer"]
        last = m.group(1).split("\n")[-1]
        assert last.endswith(f"= {ex['answer']}")
    kv = synthetic.sft_example("kv_retrieval", 0, 1, think=False)
    assert kv["response"] == f"\\boxed{{{kv['answer']}}}"
    with pytest.raises(ValueError, match="unknown synthetic task 'sorting'"):
        synthetic.make_example("sorting", 0, 0)
    with pytest.raises(ValueError, match="min_pairs"):
        synthetic.make_example("kv_retrieval", 0, 0, num_pairs=3, min_pairs=4)


def test_sft_answer_noise_boxes_a_near_miss_after_right_reasoning():
    kw = dict(num_terms=3, min_terms=2, max_operand=9)
    wrong = 0
    for i in range(400):
        clean = synthetic.sft_example("arithmetic", 0, i, **kw)
        noisy = synthetic.sft_example("arithmetic", 0, i, answer_noise=0.3, **kw)
        assert noisy["answer"] == clean["answer"] and noisy["prompt"] == clean["prompt"]
        think = re.fullmatch(r"(<think>.*</think>\n)\\boxed\{(\d+)\}", noisy["response"], re.S)
        assert think and clean["response"].startswith(think.group(1))  # reasoning untouched
        if think.group(2) != clean["answer"]:
            wrong += 1
            assert 1 <= abs(int(think.group(2)) - int(clean["answer"])) <= 3
        assert noisy == synthetic.sft_example("arithmetic", 0, i, answer_noise=0.3, **kw)
    assert 90 <= wrong <= 150  # 30% of 400, give or take three standard deviations
    kv = synthetic.sft_example("kv_retrieval", 0, 5, answer_noise=0.99)
    assert kv["response"] != f"\\boxed{{{kv['answer']}}}"
    with pytest.raises(ValueError, match="answer_noise"):
        synthetic.sft_example("arithmetic", 0, 0, answer_noise=1.0)


# ---------------------------------------------------------------------------- sources

def _write_jsonl(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return path


def test_jsonl_custom_fields_and_malformed_rows(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"question": "q1", "solution": "1", "level": 3},
        "{not json",
        {"question": "q2", "solution": 2},
        {"question": "q3"},                          # line 4: no answer
        {"question": ["q4"], "solution": "4"},       # line 5: wrong type
        "",                                          # blank: skipped silently
        {"question": "q6", "solution": "6"},
        "[1, 2]",                                    # line 8: not an object
    ])
    with caplog.at_level(logging.WARNING):
        src = sources.JsonlSource(path, prompt_field="question", answer_field="solution",
                                  system_prompt="Think.", metadata_fields=("level",))
    assert len(src) == 3 and src.num_malformed == 4
    assert [m[1] for m in src.malformed] == [2, 4, 5, 8]
    for line in (2, 4, 5, 8):
        assert f"{path}:line {line}:" in caplog.text
    assert "missing field 'solution'" in caplog.text and "'question' is a list" in caplog.text
    ex = src[1]
    assert ex["messages"] == [{"role": "system", "content": "Think."},
                              {"role": "user", "content": "q2"}]
    assert ex["answer"] == "2" and ex["prompt"] == "q2" and ex["task"] == "math"
    assert ex["metadata"] == {"file": str(path), "line": 3, "level": None}
    assert src[0]["metadata"]["level"] == 3 and src[2]["metadata"]["line"] == 7
    with pytest.raises(IndexError):
        src[3]


def test_jsonl_messages_field_and_errors(tmp_path):
    path = _write_jsonl(tmp_path / "m.jsonl", [
        {"conv": [{"role": "user", "content": "hello"}], "gold": "x", "resp": "y"},
        {"conv": [], "gold": "x", "resp": "y"},
    ])
    src = sources.file_source(str(tmp_path / "*.jsonl"), messages_field="conv",
                              answer_field="gold", response_field="resp", task="exact")
    assert isinstance(src, sources.JsonlSource) and len(src) == 1 and src.num_malformed == 1
    assert src[0]["response"] == "y" and src[0]["task"] == "exact"
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        sources.JsonlSource([path, tmp_path / "missing.jsonl"])
    with pytest.raises(FileNotFoundError, match="nothing_"):
        sources.file_source(str(tmp_path / "nothing_*.jsonl"))
    bad = _write_jsonl(tmp_path / "bad.jsonl", ["{", {"prompt": 1, "answer": "a"}])
    with pytest.raises(ValueError, match="no valid rows .*2 malformed"):
        sources.JsonlSource(bad)


def test_parquet_custom_fields(tmp_path, caplog):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["p0", None, "p2"], "ans": ["a0", "a1", "a2"],
                             "extra": [1, 2, 3]}), path)
    with caplog.at_level(logging.WARNING):
        src = sources.file_source(path, prompt_field="problem", answer_field="ans")
    assert isinstance(src, sources.ParquetSource)
    assert len(src) == 2 and src.num_malformed == 1 and f"{path}:row 1:" in caplog.text
    assert src[1]["prompt"] == "p2" and src[1]["answer"] == "a2"
    assert src[1]["metadata"] == {"file": str(path), "row": 2}
    with pytest.raises(ValueError, match="no column\\(s\\) \\['question'\\]"):
        sources.ParquetSource(path, prompt_field="question", answer_field="ans")


# ---------------------------------------------------------------------------- pipelines

def _prompt_source(tmp_path, n, seed=0):
    rng = np.random.default_rng(seed)
    rows = [{"prompt": " ".join(["word"] * int(rng.integers(1, 40))) + f" #{i}", "answer": str(i)}
            for i in range(n)]
    return sources.JsonlSource(_write_jsonl(tmp_path / f"p{n}_{seed}.jsonl", rows))


def test_length_filter_is_counted(tok, tmp_path):
    src = _prompt_source(tmp_path, 30)
    lengths = [len(prompts.tokenize_prompt(tok, src[i]["messages"])) for i in range(len(src))]
    limit = int(np.median(lengths))
    it = prompts.PromptIterator(src, tok, batch_size=1, max_prompt_len=limit, num_epochs=1)
    kept = list(it)
    assert len(kept) == sum(l <= limit for l in lengths)
    assert all(b["num_tokens"][0] <= limit and len(b["prompt_ids"][0]) == b["num_tokens"][0]
               for b in kept)
    assert kept[0]["prompt_ids"][0].dtype == np.int32
    stats = it.stats()
    assert stats["data/dropped_too_long"] == sum(l > limit for l in lengths) > 0
    assert stats["data/seen"] == 30
    with pytest.raises(ValueError, match="over the length limit"):
        next(prompts.PromptIterator(src, tok, batch_size=1, max_prompt_len=3))


def test_a_huge_row_is_cut_by_characters_before_tokenizing(tok, tmp_path, monkeypatch, caplog):
    # One 4 MB prompt took 5 s to tokenize here (a 120 MB one stalled the pipeline for
    # minutes); no token covers more than the longest vocabulary string, so a prompt with
    # more than max_prompt_len times that many characters (4x, for Unicode normalisers that
    # compose characters) cannot fit and is dropped without being tokenized.
    rows = [{"prompt": f"word {i}", "answer": str(i)} for i in range(6)]
    rows.insert(3, {"prompt": "word " * 800_000, "answer": "huge"})
    path = _write_jsonl(tmp_path / "huge.jsonl", rows)
    encoded = []
    encode = prompts._encode
    monkeypatch.setattr(prompts, "_encode",
                        lambda t, text: encoded.append(len(text)) or encode(t, text))
    it = prompts.PromptIterator(sources.JsonlSource(path), tok, batch_size=2,
                                max_prompt_len=64, num_epochs=1)
    with caplog.at_level(logging.WARNING):
        batches = list(it)
    assert sorted(a for b in batches for a in b["answer"]) == [str(i) for i in range(6)]
    assert max(encoded) < 1000  # the huge row never reached the tokenizer
    assert it.stats()["data/dropped_too_long"] == 1
    assert f"{path}" in caplog.text and "line 4" in caplog.text
    chars = len(prompts.render_prompt(tok, [{"role": "user", "content": rows[3]["prompt"]}]))
    assert f"{chars} characters" in caplog.text and "max_prompt_len=64" in caplog.text
    assert prompts.max_chars(tok, 64) == 64 * max(len(t) for t in tok.get_vocab()) * 4
    # SFT records alike (without truncation a long response cannot fit either).
    encoded.clear()
    sft_rows = [{"prompt": f"p{i}", "response": "word " * (800_000 if i == 2 else 2)}
                for i in range(5)]
    src = sources.JsonlSource(_write_jsonl(tmp_path / "sft.jsonl", sft_rows),
                              answer_field=None, response_field="response")
    sft = prompts.SFTIterator(src, tok, rows=2, row_len=64, num_epochs=1)
    assert sum(int(b["num_sequences"]) for b in sft) == 4
    assert max(encoded) < 1000 and sft.stats()["data/dropped_too_long"] == 1


def test_two_processes_get_disjoint_prompts_covering_the_dataset(tok, tmp_path):
    src = _prompt_source(tmp_path, 20)
    seen = []
    for p in range(2):
        it = prompts.PromptIterator(src, tok, batch_size=2, max_prompt_len=1000, seed=3,
                                    num_epochs=1, process_index=p, process_count=2)
        seen.append([a for b in it for a in b["answer"]])
    assert len(seen[0]) == len(seen[1]) == 10
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1], key=int) == [str(i) for i in range(20)]
    assert seen[0] + seen[1] != [str(i) for i in range(20)]  # shuffled


def test_token_balance_across_data_shards(tok, tmp_path):
    np.testing.assert_array_equal(prompts.balance_shards([10, 9, 8, 1, 1, 1], 2),
                                  [0, 3, 4, 1, 2, 5])
    with pytest.raises(ValueError, match="5 prompts do not divide over 2"):
        prompts.balance_shards([1] * 5, 2)
    src = _prompt_source(tmp_path, 64, seed=1)
    it = prompts.PromptIterator(src, tok, batch_size=16, max_prompt_len=1000, num_data_shards=4,
                                num_epochs=1)
    for batch in it:
        per_shard = batch["num_tokens"].reshape(4, 4)
        np.testing.assert_array_equal(batch["shard_tokens"], per_shard.sum(1))
        spread = batch["shard_tokens"].max() - batch["shard_tokens"].min()
        assert spread <= batch["num_tokens"].max()
        unbalanced = np.sort(batch["num_tokens"]).reshape(4, 4).sum(1)  # a bad split, for scale
        assert spread < unbalanced.max() - unbalanced.min()


def test_prompt_iterator_state_resumes_exactly(tok, tmp_path):
    src = sources.SyntheticSource("kv_retrieval", 10, seed=0, num_pairs=4)
    kw = dict(batch_size=3, max_prompt_len=1000, seed=5, num_data_shards=3)
    it = prompts.PromptIterator(src, tok, **kw)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(5)]  # crosses into later epochs
    assert it.stats()["data/epoch"] >= 2
    again = prompts.PromptIterator(src, tok, **kw)
    again.set_state(state)
    got = [next(again) for _ in range(5)]
    assert [b["metadata"] for b in got] == [b["metadata"] for b in want]
    assert all(np.array_equal(x, y) for b, c in zip(got, want)
               for x, y in zip(b["prompt_ids"], c["prompt_ids"]))
    assert again.stats() == it.stats()
    # Epochs are reshuffled: the first two epochs do not repeat the same order.
    first = prompts.PromptIterator(src, tok, batch_size=10, max_prompt_len=1000, seed=5)
    e0, e1 = ([m["index"] for m in next(first)["metadata"]] for _ in range(2))
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    other = prompts.PromptIterator(src, tok, **{**kw, "seed": 6})
    with pytest.raises(ValueError, match="saved with"):
        other.set_state(state)


def test_sft_iterator_packs_fixed_rows_and_resumes(tok):
    src = sources.SyntheticSource("arithmetic", 12, seed=0, sft=True, num_terms=3)
    kw = dict(rows=2, row_len=96, seed=1, num_epochs=1)
    it = prompts.SFTIterator(src, tok, **kw)
    batches = list(it)
    assert all(b["tokens"].shape == (2, 96) for b in batches)
    assert sum(int(b["num_sequences"]) for b in batches) == 12
    # The loss covers exactly the response tokens, each ending with EOS.
    first = batches[0]
    ends = (first["loss_mask"] > 0) & (first["targets"] == tok.eos_token_id)
    assert ends.sum() == first["num_sequences"]
    # Resume in the middle, with a record read but not yet emitted.
    it = prompts.SFTIterator(src, tok, **kw)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    rest = list(it)
    again = prompts.SFTIterator(src, tok, **kw)
    again.set_state(state)
    rest2 = list(again)
    assert len(rest) == len(rest2) == len(batches) - 1
    for a, b in zip(rest, rest2):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert again.stats()["data/seen"] == it.stats()["data/seen"] == 12
    # Records too long for a row are dropped and counted.
    short = prompts.SFTIterator(src, tok, rows=2, row_len=60, num_epochs=1)
    n = sum(int(b["num_sequences"]) for b in short)
    assert n + short.stats()["data/dropped_too_long"] == 12
