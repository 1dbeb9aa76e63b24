"""PPO's critic out of a training checkpoint, as a Hugging Face `*ForTokenClassification`.

    python -m lrl.export --role=critic --checkpoint=DIR [--step=N] --output=OUT [--dtype=...]

The critic is the checkpoint's `critic` item (PPO's, `lrl.rl.critic`): a TrainState whose
params are {"decoder": the policy's decoder tree without lm_head, "score_DL": [D, 1]}. Only
those params are read (never its optimizer state), each whole on one CPU device, from the
newest step that saved a critic (or `--step`). The export is written with
`lrl.models.score.save_hf_token_classification` (num_labels = L, `score.weight` = head^T, no
bias), reloaded with `load_hf_score` and checked against the checkpoint's values, then moved
into OUT as `lrl.export` does. transformers then loads it with
`AutoModelForTokenClassification.from_pretrained(OUT)`; its logits [B, T, 1] are the values.

`export_critic(cfg, params, head_DL, out_dir)` does the same from arrays in hand.

B rows · T positions · D model width · L labels.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from lrl.export import (_ONE_DEVICE, DEFAULT_TOL, DTYPES, _check_output, _check_params,
                        _copy_tokenizer, _model_fields, _move_into, _resolve_checkpoint)

CRITIC_ITEM = "critic"   # the checkpoint item PPO saves its critic's TrainState in


def _restore_critic(root, step: Optional[int]):
    """(step, step dir, ModelConfig, critic params) of the newest step (or `step`) that saved
    a critic: its TrainState's `params` ({"decoder", "score_DL"}) only, each whole on CPU 0,
    checked against the step's checksums when it has them."""
    import orbax.checkpoint as ocp

    from lrl import checkpoint_items as ci
    steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True)
    if step is not None:
        steps = [s for s in steps if s == step]
        if not steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {root}")
    found = [s for s in steps if (root / str(s) / CRITIC_ITEM).exists()]
    if not found:
        raise FileNotFoundError(
            f"no step in {root} saved a {CRITIC_ITEM!r} item"
            + (f" (step {step} has none)" if step is not None else "")
            + ": --role=critic needs a PPO run's checkpoint (a learned critic)")
    s = found[0]
    step_dir = root / str(s)
    if not (step_dir / "model_config").exists():
        raise ValueError(f"checkpoint step {s} in {root} has no model_config item")
    mc = ocp.JsonCheckpointHandler().restore(step_dir / "model_config",
                                             args=ocp.args.JsonRestore())
    saved = ocp.PyTreeCheckpointHandler().metadata(step_dir / CRITIC_ITEM)
    saved = getattr(saved, "tree", saved)
    if "params" not in saved or set(saved["params"]) != {"decoder", "score_DL"}:
        raise ValueError(f"the {CRITIC_ITEM!r} item of step {s} in {root} is not a critic's "
                         "TrainState (params {'decoder', 'score_DL'})")
    one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = {"params": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), saved["params"])}
    got = ocp.PyTreeCheckpointHandler().restore(
        step_dir / CRITIC_ITEM, args=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True))
    meta_dir = step_dir / "meta"
    sums = (ocp.JsonCheckpointHandler().restore(meta_dir, args=ocp.args.JsonRestore())
            .get("tree_checksums", {}).get(CRITIC_ITEM, {}) if meta_dir.exists() else {})
    for key, value in ci.checksums(got).items():
        if key in sums and sums[key] != value:
            raise ValueError(f"leaf {CRITIC_ITEM}/{key} of step {s} in {root} does not match "
                             "its checksum (garbled data)")
    return s, str(step_dir), ci.model_config_from_dict(mc), got["params"]


def _verify_critic(cfg, params, head_DL, out_dir: str, tol: float) -> float:
    """Reloads `out_dir` as a score model and compares its values with the checkpoint's."""
    from lrl.models import score as score_lib
    with jax.default_device(jax.devices("cpu")[0]):
        back_cfg, back, back_head, meta = score_lib.load_hf_score(out_dir, jnp.float32,
                                                                  **_ONE_DEVICE)
        if _model_fields(back_cfg) != _model_fields(cfg):
            raise RuntimeError(f"config.json in {out_dir} reloads as a different model")
        tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(2, 16)).astype(np.int32)
        batch = {"tokens": tokens, "segment_ids": np.ones_like(tokens),
                 "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16))}
        f32 = cfg.replace(dtype=jnp.float32, param_dtype=jnp.float32)
        ref = score_lib.token_scores(f32, jax.tree.map(lambda x: x.astype(jnp.float32), params),
                                     jnp.asarray(head_DL, jnp.float32), batch)
        got = score_lib.token_scores(back_cfg, back, back_head, batch, bias_L=meta["bias_L"])
        ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
    if not err <= tol:
        raise RuntimeError(f"export check failed: values of the reloaded {out_dir} differ from "
                           f"the checkpoint's by max rel err {err:.3g} > {tol:.3g}")
    return err


def export_critic(cfg, params, head_DL, out_dir: str, dtype: Optional[str] = None,
                  tokenizer: Optional[str] = None, verify: bool = True,
                  tol: Optional[float] = None, overwrite: bool = False,
                  max_shard_bytes: int = 4 << 30) -> dict:
    """Writes a critic (the decoder's tree without lm_head, and its value head [D, L]) as a HF
    `*ForTokenClassification` directory (num_labels = L) with the tokenizer when given,
    checked by reloading; returns a report dict."""
    from lrl.models import score as score_lib
    output = os.path.abspath(out_dir)
    _check_output(output, overwrite)
    cfg = cfg.replace(**_ONE_DEVICE)
    dtype = dtype or jnp.dtype(jax.tree.leaves(params)[0].dtype).name
    if dtype not in DTYPES:
        raise ValueError(f"the critic's parameters are {dtype}; pass --dtype")
    params = score_lib.decoder_params(params)
    _check_params(score_lib.body_config(cfg), params, "the critic")
    if jnp.ndim(head_DL) != 2 or jnp.shape(head_DL)[0] != cfg.d_model:
        raise ValueError(f"the critic's head has shape {list(jnp.shape(head_DL))}, expected "
                         f"[d_model={cfg.d_model}, labels]")
    tmp = f"{output}.tmp-export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    files = score_lib.save_hf_token_classification(cfg, params, head_DL, tmp, DTYPES[dtype],
                                                   max_shard_bytes=max_shard_bytes)
    files.append("config.json")
    if tokenizer is not None:
        files += _copy_tokenizer(tokenizer, tmp)
    err = _verify_critic(cfg, params, head_DL, tmp, DEFAULT_TOL[dtype] if tol is None
                         else tol) if verify else None
    _move_into(tmp, output)
    return {"output": output, "dtype": dtype, "files": sorted(set(files)),
            "max_rel_err": err, "num_labels": int(jnp.shape(head_DL)[1])}


def export_critic_checkpoint(checkpoint: str, output: str, step: Optional[int] = None,
                             dtype: Optional[str] = None, overwrite: bool = False,
                             tokenizer: Optional[str] = None, verify: bool = True,
                             tol: Optional[float] = None, max_shard_bytes: int = 4 << 30) -> dict:
    """`--role=critic`: the critic of `checkpoint`'s newest step that has one (or `step`)."""
    output = os.path.abspath(output)
    _check_output(output, overwrite)
    root, step = _resolve_checkpoint(checkpoint, step)
    s, path, cfg, critic = _restore_critic(root, step)
    tok_src = tokenizer or (str(root / "tokenizer") if (root / "tokenizer").exists() else None)
    report = export_critic(cfg, critic["decoder"], critic["score_DL"], output, dtype, tok_src,
                           verify, tol, overwrite, max_shard_bytes)
    return {**report, "step": s, "checkpoint": path, "format": "hf", "skipped_why": {}}
