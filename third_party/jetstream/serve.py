"""Serve a trained policy through JetStream's orchestrator and gRPC server, on localhost.

    python -m lrl.serve --checkpoint=DIR [--step=N] [--port=9000] [--max_prefill_length=1024]
                        [--max_new_tokens=512] [--slots=8] [--temperature=0] ...
    python third_party/jetstream/client.py --address=127.0.0.1:9000 --prompt="What is 3+4?"

DIR is an lrl checkpoint directory (a run's `checkpoints/`, its workdir, or one step
directory; the newest good step unless `--step`), read on one device as `lrl.export` reads
it: the parameters, the step's `model_config` and the run's `tokenizer/`. Or DIR is a Hugging
Face directory (`config.json` and safetensors, e.g. written by `python -m lrl.export`), read
by `lrl.models.load_hf` with its tokenizer. A text request is one user message, rendered by
the tokenizer's chat template as in training (`--raw_text`: tokenized as it is).

Prints `lrl.serve: serving ... on HOST:PORT (...)` once it listens; SIGINT or SIGTERM stops
it cleanly.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
from etils import epath

from lrl import checkpoint as ckpt_lib
from lrl import models
from lrl.data.tokenizer import load_tokenizer
from lrl.rollout.sampling import SamplingParams
from third_party.jetstream.engine import LrlEngine
from third_party.jetstream.server import start
from third_party.jetstream.tokenizer import HFTokenizer

log = logging.getLogger("lrl.serve")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _checkpoint_root(path: epath.Path, step):
    """A run's checkpoint dir, its workdir, or one step dir -> (checkpoint dir, step); the
    same rule as `lrl.export`."""
    if not any(c.name.isdigit() for c in path.iterdir()) and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / "state").exists() and path.name.isdigit():
        if step is not None and step != int(path.name):
            raise ValueError(f"--checkpoint={path} is step {path.name} but --step={step}")
        return path.parent, int(path.name)
    return path, step


def load_policy(checkpoint: str, step=None, tokenizer=None, dtype=None):
    """-> (ModelConfig, params on device 0, HF tokenizer, what was read)."""
    path = epath.Path(os.path.abspath(checkpoint))
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint={checkpoint}: no such directory")
    if (path / "config.json").exists():
        if step is not None:
            raise ValueError(f"--checkpoint={checkpoint} is a Hugging Face directory; --step "
                             "applies to lrl checkpoints only")
        cfg, params = models.load_hf(str(path), dtype=DTYPES[dtype or "float32"])
        tok_dir, what = tokenizer or str(path), f"Hugging Face model {path}"
    else:
        root, step = _checkpoint_root(path, step)
        got = ckpt_lib.restore_params(root, step=step, device=jax.local_devices()[0])
        if got.model_config is None:
            raise ValueError(f"checkpoint step {got.step} in {root} has no model_config item; "
                             "the training loop saves it with the train state")
        cfg, params = got.model_config, got.state
        if dtype is not None:
            cfg = cfg.replace(dtype=DTYPES[dtype])
        tok_dir, what = tokenizer or str(root / "tokenizer"), f"step {got.step} of {root}"
    # The engine has its own paged attention; the training run's sharded attention, remat
    # and parameter sharding do not apply on one device.
    cfg = cfg.replace(attention="dense", remat="none")
    return cfg, params, load_tokenizer(tok_dir), what


def build_engine(args) -> tuple[LrlEngine, str]:
    cfg, params, hf_tok, what = load_policy(args.checkpoint, args.step, args.tokenizer,
                                            args.dtype)
    eos = (tuple(int(e) for e in args.eos_ids.split(",")) if args.eos_ids
           else cfg.eos_token_ids or ((hf_tok.eos_token_id,)
                                      if hf_tok.eos_token_id is not None else ()))
    tokenizer = HFTokenizer(hf_tok, eos, chat_template=not args.raw_text)
    engine = LrlEngine(cfg, params, tokenizer, max_prefill_length=args.max_prefill_length,
                       max_new_tokens=args.max_new_tokens, max_slots=args.slots,
                       page_size=args.page_size, seed=args.seed,
                       sampling=SamplingParams(args.temperature, args.top_k, args.top_p))
    return engine, what


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m lrl.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True,
                    help="lrl checkpoint dir (or workdir, or step dir), or a Hugging Face dir")
    ap.add_argument("--step", type=int, default=None, help="step to serve (default: newest good)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer dir (default: DIR/tokenizer, or the HF dir itself)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="compute dtype (default: the checkpoint's; float32 for an HF dir)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=9000, help="port (0: any free port)")
    ap.add_argument("--max_prefill_length", type=int, default=1024,
                    help="longest prompt in positions, BOS included: a power of two, 16-32768")
    ap.add_argument("--max_new_tokens", type=int, default=512,
                    help="most tokens one request may ask for (its max_tokens)")
    ap.add_argument("--slots", type=int, default=8, help="requests decoded at once")
    ap.add_argument("--page_size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top_k", type=int, default=0, help="0: no top-k cut")
    ap.add_argument("--top_p", type=float, default=1.0, help="1: no nucleus cut")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--eos_ids", default="",
                    help="comma-separated end tokens (default: the model's, else the "
                         "tokenizer's eos_token)")
    ap.add_argument("--raw_text", action="store_true",
                    help="tokenize request text as it is, without the chat template")
    ap.add_argument("--verbose", action="store_true",
                    help="JetStream's log lines too (one per decode step)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    try:
        engine, what = build_engine(args)
        server = start(engine, host=args.host, port=args.port)
    except (OSError, ValueError, RuntimeError) as e:   # bad input: say which
        print(f"lrl.serve: error: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"lrl.serve: serving {what} on {server.address} ({engine.max_concurrent_decodes} "
          f"slots, prompts up to {engine.max_prefill_length} positions, up to "
          f"{engine.max_new_tokens} new tokens)", flush=True)
    while not stop.wait(1.0):
        pass
    server.stop()
    print("lrl.serve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
