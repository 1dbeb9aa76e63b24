"""Merged export of a training checkpoint to Hugging Face safetensors (and a PyTorch state dict).

    python -m lrl.export --checkpoint=DIR [--step=N] --output=OUT [--dtype=bfloat16]
                         [--format=hf|torch] [--overwrite] [--tokenizer=TOKDIR] [--noverify]
                         [--role=policy|critic]

Runs on one host without the training mesh: only the parameters are read (never the
optimizer state), each whole on one CPU device, from the orbax checkpoint written by
`lrl.checkpoint` (the newest good step unless `--step`; DIR may also be the run's workdir,
holding `checkpoints/`, or one step directory).
Written to OUT: `model.safetensors` (or shards plus `model.safetensors.index.json` above
`--max_shard_bytes`), `config.json`, `generation_config.json`, the tokenizer (from `--tokenizer`
or the checkpoint's `tokenizer/`) and, with `--format=torch`, `pytorch_model.bin`.

With `--role=critic` it writes PPO's critic instead (the checkpoint's `critic` item: the
decoder and its value head) as a HF `*ForTokenClassification` with one label, checked by
reloading it with `lrl.models.score.load_hf_score` and comparing values
(`lrl.export_critic`).

Everything is written to a sibling temporary directory, checked, and only then moved to OUT:
the check reloads the written files with `lrl.models.load_hf` and compares a forward pass
on a few tokens with the checkpoint's own parameters (max relative error of the logits), and
compares the PyTorch file tensor by tensor. A non-empty OUT is replaced only with
`--overwrite`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from lrl import checkpoint as ckpt_lib
from lrl import models

log = logging.getLogger("lrl.export")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Logit tolerance of the self-check: fp32 weights round-trip exactly; 16-bit ones are rounded.
DEFAULT_TOL = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}
# How the model runs here, on one CPU device: no ring/Ulysses attention, no cuDNN. (remat
# "full" because `models.abstract_params` currently fails with remat="none".)
_ONE_DEVICE = dict(attention="dense", attention_impl="xla", remat="full")
_RUNTIME_FIELDS = ("dtype", "param_dtype", "attention", "attention_impl", "remat", "scan_layers")


def _resolve_checkpoint(path: str, step: Optional[int]):
    """A run's checkpoint dir, its workdir, or one step dir -> (checkpoint dir, step or None)."""
    p = epath.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--checkpoint={path}: no such directory")
    if not any(c.name.isdigit() for c in p.iterdir()) and (p / "checkpoints").is_dir():
        p = p / "checkpoints"  # the run's workdir was given
    if (p / "state").exists() and p.name.isdigit():
        if step is not None and step != int(p.name):
            raise ValueError(f"--checkpoint={path} is step {p.name} but --step={step}")
        return p.parent, int(p.name)
    return p, step


def _check_output(output: str, overwrite: bool) -> None:
    if os.path.isfile(output):
        raise FileExistsError(f"--output={output} is a file")
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise FileExistsError(f"--output={output} exists and is not empty; pass --overwrite "
                              "to replace its contents")


def _model_fields(cfg) -> dict:
    d = dataclasses.asdict(cfg)
    return {k: v for k, v in d.items() if k not in _RUNTIME_FIELDS}


def _check_params(cfg, params, where: str) -> None:
    want = models.abstract_params(cfg)
    got_s = {jax.tree_util.keystr(p): x.shape for p, x in
             jax.tree_util.tree_flatten_with_path(params)[0]}
    want_s = {jax.tree_util.keystr(p): x.shape for p, x in
              jax.tree_util.tree_flatten_with_path(want)[0]}
    if got_s != want_s:
        diff = sorted(k for k in set(got_s) | set(want_s) if got_s.get(k) != want_s.get(k))
        raise ValueError(f"the parameters in {where} do not fit their model_config: "
                         + ", ".join(f"{k}: {got_s.get(k)} vs {want_s.get(k)}" for k in diff[:6]))


def _copy_tokenizer(src, dst: str) -> list[str]:
    src = epath.Path(src)
    files = [p for p in src.iterdir() if p.is_file()] if src.is_dir() else []
    if not files:
        raise FileNotFoundError(f"tokenizer directory {src} has no files")
    for p in files:
        p.copy(epath.Path(dst) / p.name, overwrite=True)
    return sorted(p.name for p in files)


def _generation_config(cfg, tokenizer_dir: Optional[str]) -> dict:
    bos, eos, pad = cfg.bos_token_id, list(cfg.eos_token_ids), None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        if len(tok) > cfg.vocab_size:
            log.warning("export: the tokenizer has %d tokens, the model's vocabulary %d",
                        len(tok), cfg.vocab_size)
        bos = tok.bos_token_id if bos is None else bos
        eos = eos or ([tok.eos_token_id] if tok.eos_token_id is not None else [])
        pad = tok.pad_token_id
    out = {"bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    if pad is not None:
        out["pad_token_id"] = pad
    return out


def _torch_state(state: dict, tie_embeddings: bool):
    import torch  # only the torch export needs it

    def tensor(a):
        if a.dtype == jnp.bfloat16:
            return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))
    sd = {k: tensor(v) for k, v in state.items()}
    if tie_embeddings:  # transformers' state_dict lists the tied head under its own name
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def _verify(cfg, params, out_dir: str, fmt: str, tol: float) -> float:
    """Reloads `out_dir` and compares logits with the checkpoint's; returns max rel err."""
    cpu = jax.devices("cpu")[0]
    run = _ONE_DEVICE
    with jax.default_device(cpu):
        back_cfg, back = models.load_hf(out_dir, dtype=jnp.float32, **run)
        if _model_fields(back_cfg) != _model_fields(cfg):
            raise RuntimeError(f"config.json in {out_dir} reloads as a different model: "
                               f"{_model_fields(back_cfg)} vs {_model_fields(cfg)}")
        tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(2, 16))
        ref_cfg = cfg.replace(dtype=jnp.float32, param_dtype=jnp.float32, **run)
        ref = models.forward(ref_cfg, jax.tree.map(lambda x: x.astype(jnp.float32), params),
                             tokens)
        got = models.forward(back_cfg, back, tokens)
        ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
    if not err <= tol:
        raise RuntimeError(f"export check failed: logits of the reloaded {out_dir} differ from "
                           f"the checkpoint's by max rel err {err:.3g} > {tol:.3g}")
    if fmt == "torch":
        import torch
        from lrl.models.hf_io import SafetensorsDir
        sd = torch.load(os.path.join(out_dir, "pytorch_model.bin"), weights_only=True)
        st = SafetensorsDir(out_dir)
        for k in st.keys():
            a = sd[k].view(torch.uint16).numpy() if sd[k].dtype == torch.bfloat16 else sd[k].numpy()
            if not np.array_equal(a, np.asarray(st.get(k)).view(a.dtype)):
                raise RuntimeError(f"pytorch_model.bin tensor {k!r} differs from the safetensors")
    return err


def export(checkpoint: str, output: str, step: Optional[int] = None, dtype: Optional[str] = None,
           fmt: str = "hf", overwrite: bool = False, tokenizer: Optional[str] = None,
           verify: bool = True, tol: Optional[float] = None, max_shard_bytes: int = 4 << 30,
           params_key: str = "params") -> dict:
    """Writes the merged model of `checkpoint` to `output`; returns a report dict."""
    if fmt not in ("hf", "torch"):
        raise ValueError(f"--format={fmt!r}; choose 'hf' or 'torch'")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r}; choose one of {sorted(DTYPES)}")
    output = os.path.abspath(output)
    _check_output(output, overwrite)
    root, step = _resolve_checkpoint(checkpoint, step)
    got = ckpt_lib.restore_params(root, step=step, params_key=params_key)
    if got.model_config is None:
        raise ValueError(f"checkpoint step {got.step} in {root} has no model_config item; the "
                         "training loop must save it (CheckpointManager.save(model_config=...))")
    cfg, params = got.model_config.replace(**_ONE_DEVICE), got.state
    _check_params(cfg, params, got.path)
    dtype = dtype or jnp.dtype(jax.tree.leaves(params)[0].dtype).name
    if dtype not in DTYPES:
        raise ValueError(f"the checkpoint's parameters are {dtype}; pass --dtype")
    tok_src = tokenizer or (str(root / "tokenizer") if (root / "tokenizer").exists() else None)

    tmp = f"{output}.tmp-export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = models.save_hf(cfg, params, tmp, dtype=DTYPES[dtype], max_shard_bytes=max_shard_bytes)
    files.append("config.json")
    if tok_src is not None:
        files += _copy_tokenizer(tok_src, tmp)
    else:
        log.warning("export: no tokenizer (neither --tokenizer nor %s/tokenizer): writing the "
                    "weights and config only", root)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(_generation_config(cfg, tmp if tok_src else None), f, indent=2)
    files.append("generation_config.json")
    if fmt == "torch":
        import torch
        hf_state = models.to_hf_state(cfg, params, DTYPES[dtype])
        torch.save(_torch_state(hf_state, cfg.tie_embeddings),
                   os.path.join(tmp, "pytorch_model.bin"))
        files.append("pytorch_model.bin")
    err = _verify(cfg, params, tmp, fmt, DEFAULT_TOL[dtype] if tol is None else tol) \
        if verify else None

    _move_into(tmp, output)
    report = {"step": got.step, "checkpoint": got.path, "output": output, "dtype": dtype,
              "format": fmt, "files": sorted(set(files)), "max_rel_err": err,
              "skipped": [s for s, _, _ in got.skipped],
              "skipped_why": {s: why for s, _, why in got.skipped}}
    log.debug("export: %s", report)  # main prints it; a caller has it returned
    return report


def _move_into(tmp: str, output: str) -> None:
    """The checked temporary directory becomes `output` (its old contents removed)."""
    if os.path.isdir(output) and os.listdir(output):
        old = f"{output}.old-export-{os.getpid()}"
        os.replace(output, old)
        os.replace(tmp, output)
        shutil.rmtree(old)
    else:
        if os.path.isdir(output):
            os.rmdir(output)
        os.replace(tmp, output)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lrl.export", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="run checkpoint directory (or a step dir)")
    ap.add_argument("--step", type=int, default=None, help="step to export (default: newest good)")
    ap.add_argument("--output", required=True, help="directory to write the HF model to")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="dtype of the written weights (default: the checkpoint's)")
    ap.add_argument("--format", choices=("hf", "torch"), default="hf",
                    help="torch: also write pytorch_model.bin")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: DIR/tokenizer)")
    ap.add_argument("--noverify", action="store_true", help="skip the reload check")
    ap.add_argument("--tol", type=float, default=None, help="max rel err of the reload check")
    ap.add_argument("--max_shard_bytes", type=int, default=4 << 30,
                    help="safetensors shard size above which the weights are split")
    ap.add_argument("--params_key", default="params",
                    help="top-level entry of the state holding the parameters")
    ap.add_argument("--role", choices=("policy", "critic"), default="policy",
                    help="critic: PPO's critic as a HF *ForTokenClassification")
    args = ap.parse_args(argv)
    from lrl import console
    console.setup_logging()
    try:
        if args.role == "critic":
            if args.format != "hf":
                raise ValueError("--role=critic writes --format=hf only")
            from lrl.export_critic import export_critic_checkpoint
            report = export_critic_checkpoint(
                args.checkpoint, args.output, step=args.step, dtype=args.dtype,
                overwrite=args.overwrite, tokenizer=args.tokenizer, verify=not args.noverify,
                tol=args.tol, max_shard_bytes=args.max_shard_bytes)
        else:
            report = export(args.checkpoint, args.output, step=args.step, dtype=args.dtype,
                            fmt=args.format, overwrite=args.overwrite,
                            tokenizer=args.tokenizer, verify=not args.noverify, tol=args.tol,
                            max_shard_bytes=args.max_shard_bytes, params_key=args.params_key)
    except (OSError, ValueError, RuntimeError) as e:  # bad input or a failed check: say which
        print(f"lrl.export: error: {e}", file=sys.stderr)
        return 1
    err = report["max_rel_err"]
    # A newer step that could not be read is said here, on the line a script or person reads,
    # not only in the warnings above it.
    skipped = "".join(f"; skipped newer step {s} (unreadable: {why})"
                      for s, why in report["skipped_why"].items())
    print(f"exported step {report['step']} of {report['checkpoint']} to {report['output']} "
          f"({report['dtype']}, {len(report['files'])} files"
          + (f", reload check max rel err {err:.3g})" if err is not None else ", not checked)")
          + skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
