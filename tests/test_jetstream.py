"""lrl's engine behind JetStream 0.2.2 (third_party/jetstream): JetStream's own orchestrator
drives the adapter to the same greedy tokens as `lrl.rollout.generate` (more requests than
slots, an end token, refused prompts that do not stop it), a gRPC server on 127.0.0.1
answers a chat prompt with the expected text and refuses requests past its limits while it
keeps serving, and `python -m lrl.serve` serves an lrl checkpoint to the client script.

A tiny random model and a tokenizer trained on the synthetic corpus; nothing downloaded.
"""
import asyncio
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jetstream", reason="google-jetstream is not installed "
                                        "(requirements-serve.txt)")
grpc = pytest.importorskip("grpc")

import lrl.models as models  # noqa: E402
import lrl.rollout as rollout  # noqa: E402
from lrl import checkpoint as ckpt_lib  # noqa: E402
from lrl.data.synthetic import synthetic_corpus  # noqa: E402
from lrl.data.tokenizer import build_tokenizer  # noqa: E402
from third_party.jetstream import client, server  # noqa: E402
from third_party.jetstream.engine import LrlEngine  # noqa: E402
from third_party.jetstream.serve import load_policy  # noqa: E402
from third_party.jetstream.tokenizer import HFTokenizer, StreamText  # noqa: E402

from jetstream.core import orchestrator  # noqa: E402  (after compat.install, via the above)
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_NEW = 12
# Small pages and blocks: prompts cross pages, attention loops over several page blocks.
SIZES = dict(max_prefill_length=32, max_new_tokens=MAX_NEW, max_slots=3, page_size=4,
             prefill_block_pages=2, decode_block_pages=2)
PROMPT = "What is 3 + 4?"


def greedy(cfg, params, prompts, eos=()):
    outs = rollout.generate(cfg, params, prompts, max_new_tokens=MAX_NEW, eos_ids=eos,
                            page_size=4)
    return [[int(t) for t in o[0][0]] for o in outs]


def reply(tokens, eos, max_tokens):
    """What JetStream returns of a greedy generation: at most max_tokens, the end token cut."""
    out = tokens[:max_tokens]
    return out[:out.index(eos)] if eos in out else out


@pytest.fixture(scope="module")
def policy():
    tok = build_tokenizer(synthetic_corpus(200), 300)
    cfg = models.ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=8, mlp_dim=64, remat="none")
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    prompts = [rng.randint(4, 300, size=n).astype(np.int32) for n in (1, 2, 5, 9, 16, 23, 31)]
    free = greedy(cfg, params, prompts)
    # An end token that the greedy replies reach mid-way: the first token seen at index >= 2
    # that is not at index 0 or 1 of any reply (so no reply is cut to nothing).
    early = {t for out in free for t in out[:2]}
    eos = next(t for out in free for t in out[2:] if t not in early)
    return cfg, params, tok, prompts, eos


def _run(orch, requests):
    """Sends all requests at once; -> [(token ids, text)] per request."""
    async def one(request):
        ids, text = [], []
        async for response in orch.Decode(request):
            for sample in response.stream_content.samples:
                ids += list(sample.token_ids)
                text.append(sample.text)
        return ids, "".join(text)

    async def every():
        return await asyncio.gather(*map(one, requests))
    return asyncio.run(every())


def _tokens_request(ids, max_tokens):
    return jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=list(map(int, ids))),
        max_tokens=max_tokens)


def test_orchestrator_matches_generate(policy):
    cfg, params, tok, prompts, eos = policy
    max_tokens = [12, 3, 7, 12, 1, 9, 5]
    want_full = greedy(cfg, params, prompts, eos=(eos,))
    want = [reply(w, eos, m) for w, m in zip(want_full, max_tokens)]
    assert any(eos in w[:m] for w, m in zip(want_full, max_tokens)), "no reply met the end token"

    engine = LrlEngine(cfg, params, HFTokenizer(tok, (eos,)), **SIZES)
    driver = server.make_driver(engine)
    try:
        # JetStream's own servicer, not lrl's: 7 requests for 3 slots, one token ids each.
        orch = orchestrator.LLMOrchestrator(driver)
        got = _run(orch, [_tokens_request(p, m) for p, m in zip(prompts, max_tokens)])
        assert [g[0] for g in got] == want
        # Requests its servicer lets through although the engine cannot serve them: a prompt
        # past max_prefill_length (34 positions with the BOS), ids outside the vocabulary.
        # They end with no tokens, and the next request is served.
        got = _run(orch, [_tokens_request(np.full(33, 7), 5),
                          _tokens_request([5, cfg.vocab_size], 5),
                          _tokens_request(prompts[3], 12)])
        assert [g[0] for g in got] == [[], [], want[3]]
        assert driver.live
    finally:
        driver.stop()
    pool = engine._engine.pool   # every page is free or held by one of the 3 slots
    assert pool.num_used == sum(len(p) for p in engine._engine.slot_pages if p)


def test_disaggregated_driver_and_seeded_sampling_match_generate(policy):
    """Prefill and generate on two engines (the prefix moves by device_put to the generate
    engine's sharding), sampling at temperature 1 with top-k: the same draws as generate,
    whose sample p is our p-th admitted request."""
    cfg, params, tok, prompts, eos = policy
    sampling = dict(temperature=1.0, top_k=20)
    outs = rollout.generate(cfg, params, prompts, max_new_tokens=MAX_NEW, eos_ids=(eos,),
                            page_size=4, seed=3, **sampling)
    want = [reply([int(t) for t in o[0][0]], eos, MAX_NEW) for o in outs]
    assert want != [reply(g, eos, MAX_NEW) for g in greedy(cfg, params, prompts, (eos,))]

    engines = [LrlEngine(cfg, params, HFTokenizer(tok, (eos,)), seed=3,
                         sampling=rollout.SamplingParams(**sampling), **SIZES)
               for _ in range(2)]
    p = engines[0].load_params()
    driver = orchestrator.Driver(prefill_engines=engines[:1], generate_engines=engines[1:],
                                 prefill_params=[p], generate_params=[p],
                                 interleaved_mode=False, jax_padding=True)
    try:
        orch = orchestrator.LLMOrchestrator(driver)
        got = _run(orch, [_tokens_request(q, MAX_NEW) for q in prompts])
    finally:
        driver.stop()
    assert [g[0] for g in got] == want


def test_grpc_server_chat_limits_and_recovery(policy):
    cfg, params, tok, _, eos = policy
    tokenizer = HFTokenizer(tok, (eos,))
    ids = tokenizer.prompt_ids(PROMPT)
    want = reply(greedy(cfg, params, [ids], eos=(eos,))[0], eos, 10)
    want_text = tok.decode(want, skip_special_tokens=True)
    assert want_text

    srv = server.start(LrlEngine(cfg, params, tokenizer, **SIZES), "127.0.0.1", 0)
    try:
        assert srv.address.startswith("127.0.0.1:")
        assert "".join(client.stream(srv.address, PROMPT, 10)) == want_text
        refused = [("x " * 40, 10, "max_prefill_length=32"),
                   (PROMPT, MAX_NEW + 1, f"max_new_tokens={MAX_NEW}"),
                   (PROMPT, 0, "max_tokens=0")]
        for prompt, max_tokens, says in refused:
            with pytest.raises(grpc.RpcError) as e:
                list(client.stream(srv.address, prompt, max_tokens))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in e.value.details()
        with grpc.insecure_channel(srv.address) as channel:   # still serving
            stub = jetstream_pb2_grpc.OrchestratorStub(channel)
            assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest()).is_live
            ids_reply = [list(r.stream_content.samples[0].token_ids)
                         for r in stub.Decode(_tokens_request(ids, 10))]
        assert sum(ids_reply, []) == want
        assert "".join(client.stream(srv.address, PROMPT, 10)) == want_text
    finally:
        srv.stop()


def test_prompts_are_rendered_as_in_training(policy):
    from lrl.data.prompts import tokenize_prompt
    tok = policy[2]
    for text in (PROMPT, "two\nlines, <think> and 12345"):
        np.testing.assert_array_equal(
            HFTokenizer(tok, (3,)).prompt_ids(text),
            tokenize_prompt(tok, [{"role": "user", "content": text}]))
        np.testing.assert_array_equal(
            HFTokenizer(tok, (3,), chat_template=False).prompt_ids(text),
            tok(text, add_special_tokens=False)["input_ids"])


def test_stream_text_keeps_characters_whole(policy):
    tok = policy[2]
    tokenizer = HFTokenizer(tok, (3,))
    text = "naïve 漢字 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # Byte-level tokens split the non-ASCII characters: decoded one by one (as JetStream
    # does) they come out as U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    stream = StreamText(tokenizer)
    pieces = [stream.add([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_engine_api_properties_and_refusals(policy):
    cfg, params, tok, _, eos = policy
    tokenizer = HFTokenizer(tok, (eos,))
    engine = LrlEngine(cfg, params, tokenizer, **SIZES)   # an ABC: every method is there
    assert (engine.max_concurrent_decodes, engine.samples_per_slot,
            engine.max_prefill_length) == (3, 1, 32)
    assert engine.mesh.devices.size == 1 and engine.colocated_cpus
    assert engine.get_prefix_destination_sharding().device_set == {engine.device}
    assert engine.build_tokenizer(engine.get_tokenizer()) is tokenizer
    assert tokenizer.stop_tokens == {eos} and tokenizer.bos_id == -1
    padded, n = tokenizer.encode(PROMPT, is_bos=True, max_prefill_length=32, jax_padding=False)
    assert n == len(tokenizer.prompt_ids(PROMPT)) + 1 and padded[0] == -1
    assert len(padded) in (16, 32)
    with pytest.raises(ValueError, match="max_prefill_length=100"):
        LrlEngine(cfg, params, HFTokenizer(tok, (eos,)), **{**SIZES, "max_prefill_length": 100})
    with pytest.raises(ValueError, match="no end tokens"):
        HFTokenizer(tok, ())


def _save_run(tmp_path, cfg, params, tok):
    """A run's workdir/checkpoints as the loop writes it (a train state holding params)."""
    ckpt = tmp_path / "run" / "checkpoints"
    with ckpt_lib.CheckpointManager(ckpt, async_save=False) as mgr:
        mgr.save(5, {"params": params, "step": jnp.int32(5)}, model_config=cfg)
        mgr.save_tokenizer(tok)
    return ckpt


def test_load_policy_reads_lrl_checkpoints_and_hf_dirs(policy, tmp_path):
    cfg, params, tok, _, eos = policy
    ckpt = _save_run(tmp_path, cfg.replace(eos_token_ids=(eos,)), params, tok)
    models.save_hf(cfg, params, str(tmp_path / "hf"))
    tok.save_pretrained(str(tmp_path / "hf"))
    for path, what in [(ckpt, "step 5 of"), (ckpt.parent, "step 5 of"), (ckpt / "5", "step 5 of"),
                       (tmp_path / "hf", "Hugging Face model")]:
        got_cfg, got, got_tok, said = load_policy(str(path))
        assert said.startswith(what) and len(got_tok) == len(tok)
        assert (got_cfg.vocab_size, got_cfg.n_layers) == (cfg.vocab_size, cfg.n_layers)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert load_policy(str(ckpt))[0].eos_token_ids == (eos,)
    with pytest.raises(FileNotFoundError, match="no/such"):
        load_policy(str(tmp_path / "no" / "such"))


@pytest.mark.slow
def test_python_m_lrl_serve_and_the_client_script(policy, tmp_path):
    cfg, params, tok, _, eos = policy
    ckpt = _save_run(tmp_path, cfg.replace(eos_token_ids=(eos,)), params, tok)
    ids = HFTokenizer(tok, (eos,)).prompt_ids(PROMPT)
    want_text = tok.decode(reply(greedy(cfg, params, [ids], eos=(eos,))[0], eos, 10),
                           skip_special_tokens=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lrl.serve", f"--checkpoint={ckpt}", "--port=0",
         "--max_prefill_length=32", f"--max_new_tokens={MAX_NEW}", "--slots=2",
         "--page_size=4"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("lrl.serve: serving"):
                break
        assert lines and lines[-1].startswith("lrl.serve: serving step 5 of"), "".join(lines)
        address = lines[-1].split(" on ")[1].split()[0]

        def ask(prompt, max_tokens):
            return subprocess.run(
                [sys.executable, "third_party/jetstream/client.py", f"--address={address}",
                 f"--prompt={prompt}", f"--max_tokens={max_tokens}"],
                cwd=ROOT, capture_output=True, text=True, timeout=120)
        out = ask(PROMPT, 10)
        assert out.returncode == 0 and out.stdout == want_text + "\n", out.stderr
        out = ask("x " * 40, 10)
        assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr
        assert "max_prefill_length=32" in out.stderr
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "lrl.serve: stopped" in rest, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_compat_layer():
    import logging

    from jetstream.engine import token_utils

    from third_party.jetstream import compat
    assert compat.check_version() == compat.UPSTREAM_VERSION
    # The published delete_pytree called jax.tree_map, absent from this jax.
    assert not hasattr(jax, "tree_map")
    tree = {"a": jnp.ones(3), "b": [jnp.zeros(2), np.ones(2)]}
    orchestrator.delete_pytree(tree)
    assert tree["a"].is_deleted() and tree["b"][0].is_deleted()
    # seqio is a stand-in: what needs the real one says so.
    with pytest.raises(ImportError, match="seqio"):
        token_utils.load_vocab("/no/such/spm.model")
    # Importing the orchestrator no longer turns the root logger to DEBUG on stdout.
    assert logging.getLogger().level != logging.DEBUG


def test_a_stream_ending_after_its_loop_closed_is_no_error():
    """JetStream 0.2.2 ended a stream with two callbacks onto the consumer's loop; the second
    raised "Event loop is closed" in the detokenize thread (a SIGKILL) once the consumer had
    closed its loop (compat._patch_multifuture)."""
    import threading

    from jetstream.core.utils.async_multifuture import AsyncMultifuture

    async def make():
        return AsyncMultifuture()
    loop = asyncio.new_event_loop()
    channel = loop.run_until_complete(make())
    loop.close()
    errors = []

    def detokenizer():
        try:
            channel.add_result(["late"])
            channel.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    t = threading.Thread(target=detokenizer)
    t.start()
    t.join()
    assert not errors

    async def stream():   # on a live loop, results and the end arrive as before
        ch = AsyncMultifuture()
        threading.Thread(target=lambda: (ch.add_result(1), ch.add_result(2), ch.close())).start()
        return [r async for r in ch], ch
    got, ch = asyncio.run(stream())
    assert got == [1, 2] and ch.done()
