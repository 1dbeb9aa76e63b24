"""The decoder with a scalar (or L-label) head: the critic and the reward model.

A score model is the policy's decoder without its unembedding, and a head `head_DL` [D, L]
(L = 1 for a critic or a reward model) on the final-normalised hidden states, as transformers'
`*ForTokenClassification` (per token) and `*ForSequenceClassification` (read at the last
token) compute them. It reuses everything of the decoder: its parameter tree (less `lm_head`),
its shardings, scanned layers, remat policy, packing, and ring / Ulysses attention over `seq`.

    cfg, params, head_DL, meta = load_hf_score(path, mesh=mesh)
    scores_BTL = token_scores(cfg, params, head_DL, batch, mesh=mesh)
    save_hf_token_classification(cfg, params, head_DL, out_dir)

The decoder is run as its tied-embedding variant (`body_config`): a tied decoder has no
`lm_head` parameter and computes the same hidden states, so the score model's tree is the
policy's tree without `lm_head` whatever the checkpoint's `tie_word_embeddings` says.

B batch · T positions · D model width · L labels (here, not layers).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from lrl import mesh as mesh_lib
from lrl.models import config as config_lib
from lrl.models import hf_io
from lrl.models.config import ModelConfig
from lrl.models.forward import batch_hidden_states
from lrl.models.params import abstract_params, param_shardings

# The head's logical axes: D shards like every other model dimension, the labels stay whole.
HEAD_AXES = ("embed", None)
_KINDS = ("ForSequenceClassification", "ForTokenClassification")
_FAMILY = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def body_config(cfg: ModelConfig) -> ModelConfig:
    """The decoder config a score model runs: tied embeddings, so no `lm_head` parameter."""
    return cfg.replace(tie_embeddings=True)


def decoder_params(params):
    """The policy's parameter tree -> the score model's decoder tree (drops `lm_head`)."""
    return {k: v for k, v in params.items() if k != "lm_head"}


def abstract_score_params(cfg: ModelConfig):
    return abstract_params(body_config(cfg))


def score_param_shardings(cfg: ModelConfig, mesh):
    """The decoder tree's shardings (the policy's, less `lm_head`)."""
    return param_shardings(body_config(cfg), mesh)


def head_sharding(cfg: ModelConfig, mesh, num_labels: int = 1):
    """`head_DL`'s sharding: D over `cfg.param_shard_axes` where they divide it."""
    rules = {**mesh_lib.PARAM_RULES, "embed": tuple(cfg.param_shard_axes)}
    spec = mesh_lib.spec_for(HEAD_AXES, (cfg.d_model, num_labels), mesh, rules)
    return NamedSharding(mesh, spec)


def init_head(cfg: ModelConfig, rng, num_labels: int = 1, stddev: float = 0.02, mesh=None):
    """A fresh head [D, L] ~ N(0, stddev²) (transformers' default initializer_range), in
    `cfg.param_dtype`, created in its sharding on `mesh`."""
    def init(r):
        return (stddev * jax.random.normal(r, (cfg.d_model, num_labels))).astype(cfg.param_dtype)
    out = None if mesh is None else head_sharding(cfg, mesh, num_labels)
    return jax.jit(init, out_shardings=out)(rng)


def token_scores(cfg: ModelConfig, params, head_DL, batch, mesh=None, *, extra=None,
                 packed: bool = True, hidden: Callable = batch_hidden_states,
                 bias_L: Optional[jax.Array] = None):
    """float32 scores [B, T, L]: the final hidden states (after the final norm) @ `head_DL`.

    `batch` holds `tokens`, `positions` and (packed rows) `segment_ids`, as the update's
    micro-batches do; `hidden` is the update's hidden-state function (the text decoder's by
    default). Inputs and outputs are in natural token order on any mesh. `bias_L`: a token
    classification checkpoint's `score.bias` (`meta["bias_L"]`), or None."""
    x_BTD = hidden(body_config(cfg), params, batch, extra, mesh, packed)
    s_BTL = jnp.einsum("btd,dl->btl", x_BTD, head_DL.astype(x_BTD.dtype),
                       preferred_element_type=jnp.float32)
    return s_BTL if bias_L is None else s_BTL + jnp.asarray(bias_L, jnp.float32)


# ----------------------------------------------------------------------------- HF I/O

def _classification_kind(path: str, hf: dict) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        for kind in _KINDS:
            if arch.endswith(kind):
                return kind
    raise ValueError(f"{os.path.join(path, 'config.json')}: architectures={archs} is not a "
                     "*ForSequenceClassification or *ForTokenClassification model (a reward "
                     "model or critic needs a `score` head; lrl reads Llama / Qwen2 / Qwen3 "
                     "ones)")


def load_hf_score(path: str, dtype=jnp.float32, mesh=None, **overrides):
    """A local HF `*ForSequenceClassification` / `*ForTokenClassification` directory ->
    (cfg, params, head_DL, meta), sharded over `mesh` when given.

    The decoder's weights load as `load_hf` loads a CausalLM's (`model.*`; there is no
    `lm_head`); `score.weight` [L, D] becomes `head_DL`. `meta`: num_labels, pad_token_id,
    architecture, kind ("ForSequenceClassification" or "ForTokenClassification") and bias_L
    (`score.bias` as a host array, or None)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in score model directory {path!r}")
    hf = config_lib.read_json(config_path)
    kind = _classification_kind(path, hf)
    cfg = config_lib.from_hf_dict(hf, **{"param_dtype": dtype, "dtype": dtype, **overrides})
    st = hf_io.SafetensorsDir(path)
    if "score.weight" not in st:
        raise KeyError(f"tensor 'score.weight' is missing from the checkpoint in {path!r} "
                       f"(config.json says {hf.get('architectures')})")
    w_LD = np.asarray(st.get("score.weight"))
    labels = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels")
    if w_LD.ndim != 2 or w_LD.shape[1] != cfg.d_model or (labels and w_LD.shape[0] != labels):
        raise ValueError(f"{path!r}: score.weight has shape {list(w_LD.shape)}, expected "
                         f"[num_labels={labels}, hidden_size={cfg.d_model}]")
    bias = np.asarray(st.get("score.bias"), np.float32) if "score.bias" in st else None
    if bias is not None and bias.shape != (w_LD.shape[0],):
        raise ValueError(f"{path!r}: score.bias has shape {list(bias.shape)}, expected "
                         f"[{w_LD.shape[0]}]")
    params = hf_io.load_params(body_config(cfg), st, mesh)
    L = w_LD.shape[0]
    sharding = (head_sharding(cfg, mesh, L) if mesh is not None
                else SingleDeviceSharding(jax.devices()[0]))
    head = np.ascontiguousarray(w_LD.T.astype(np.dtype(jnp.dtype(cfg.param_dtype))))
    head_DL = jax.make_array_from_callback(head.shape, sharding, lambda i: head[i])
    meta = dict(num_labels=L, pad_token_id=hf.get("pad_token_id"),
                architecture=(hf.get("architectures") or [None])[0], kind=kind, bias_L=bias)
    return cfg, params, head_DL, meta


def save_hf_token_classification(cfg: ModelConfig, params, head_DL, out_dir: str, dtype=None,
                                 bias_L=None, pad_token_id=None,
                                 max_shard_bytes: int = 4 << 30) -> list[str]:
    """Writes a HF `*ForTokenClassification` directory (num_labels = L) that transformers
    loads: the decoder as `save_hf` writes it, `score.weight` [L, D] and, when `bias_L` is
    given, `score.bias` (else config says token_classification_bias=false)."""
    params = decoder_params(params)
    state = hf_io.to_hf_state(body_config(cfg), params, dtype)
    saved = (np.dtype(jnp.dtype(dtype)) if dtype is not None
             else np.dtype(jnp.dtype(cfg.param_dtype)))
    head = np.asarray(jax.device_get(head_DL))
    if head.ndim != 2 or head.shape[0] != cfg.d_model:
        raise ValueError(f"save_hf_token_classification: head_DL has shape {list(head.shape)}, "
                         f"expected [d_model={cfg.d_model}, num_labels]")
    state["score.weight"] = np.ascontiguousarray(head.T.astype(saved))
    if bias_L is not None:
        state["score.bias"] = np.asarray(jax.device_get(bias_L)).astype(saved).reshape(-1)
    hf = hf_io.hf_config(cfg, saved)
    L = head.shape[1]
    hf.update(architectures=[_FAMILY[cfg.model_type] + "ForTokenClassification"],
              id2label={str(i): f"LABEL_{i}" for i in range(L)},
              label2id={f"LABEL_{i}": i for i in range(L)},
              token_classification_bias=bias_L is not None, pad_token_id=pad_token_id)
    return hf_io.write_hf_dir(out_dir, state, hf, max_shard_bytes)
