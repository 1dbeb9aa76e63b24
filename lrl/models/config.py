"""Model configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 decoder family,
read from a Hugging Face `config.json` or built by hand for tests.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_KINDS = ("dense", "ring", "ulysses")
PARAM_SHARD_AXES = ("fsdp", "seq")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "dots_attn", "save_attn",
                  "offload_attn")


def dtype(name: str):
    """The jnp dtype a config names (`model.dtype`, `model.param_dtype`)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_param_shard_axes(axes, name="param_shard_axes", shown=None) -> None:
    """Distinct axes from PARAM_SHARD_AXES, else a ValueError naming `name` and `shown`."""
    if any(a not in PARAM_SHARD_AXES for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"{name}={axes if shown is None else shown!r}; give distinct axes "
                         f"from {PARAM_SHARD_AXES}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling; `kind="default"` means none."""
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 256
    d_model: int = 64            # D
    n_layers: int = 2            # L
    n_heads: int = 4             # N
    n_kv_heads: int = 2          # K
    head_dim: int = 16           # H
    mlp_dim: int = 128           # F
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    qkv_bias: bool = False       # Qwen2 / Qwen2.5
    o_bias: bool = False         # Llama with attention_bias=True
    mlp_bias: bool = False
    qk_norm: bool = False        # Qwen3
    tie_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # Multimodal RoPE (Qwen2-VL / Qwen2.5-VL): frequency-section sizes (summing to head_dim/2)
    # rotated by the temporal, height and width position; empty for plain RoPE.
    mrope_section: tuple[int, ...] = ()
    # How it runs, not what it is:
    dtype: Any = jnp.float32          # compute dtype
    param_dtype: Any = jnp.float32    # storage dtype (fp32 master weights when training)
    attention: str = "dense"          # dense | ring | ulysses
    attention_impl: Optional[str] = None  # None: cuDNN on GPU in bf16/fp16, else XLA
    remat: str = "full"               # one of REMAT_POLICIES
    scan_layers: bool = True
    # Mesh axes that shard the parameters' model dimension (and so the optimizer state), in
    # order. ("fsdp", "seq") makes the sequence-parallel devices FSDP shards as well, as
    # verl's FSDP spans every rank: a 7B model's fp32 masters and Adam moments then fit when
    # one sequence spans a whole node.
    param_shard_axes: tuple[str, ...] = ("fsdp",)
    # Runs (packed sequences) a row may hold on cuDNN's packed attention; more give NaN. The
    # update sets it from its rows' length (`flash.segments_for`): the packed backward's
    # buffers grow with it, whatever the rows hold.
    max_segments: int = 64

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; lrl supports "
                             f"{SUPPORTED_MODEL_TYPES}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={self.attention!r}; choose one of {ATTENTION_KINDS}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        if self.mrope_section and 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section={self.mrope_section} must sum to head_dim/2 = "
                             f"{self.head_dim // 2}")
        check_param_shard_axes(self.param_shard_axes)
        if self.max_segments < 2:
            raise ValueError(f"max_segments={self.max_segments}: cuDNN's packed layout needs 2 "
                             "at least (a sequence and the row's padding)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        D, F, N, K, H, V, L = (self.d_model, self.mlp_dim, self.n_heads, self.n_kv_heads,
                               self.head_dim, self.vocab_size, self.n_layers)
        per_layer = D * N * H * 2 + D * K * H * 2 + 3 * D * F + 2 * D
        per_layer += (N + 2 * K) * H if self.qkv_bias else 0
        per_layer += 2 * H if self.qk_norm else 0
        return L * per_layer + V * D * (1 if self.tie_embeddings else 2) + D


def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` and `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or {}) or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind == "default":
        return theta, RopeScaling()
    if kind != "llama3":
        raise ValueError(f"unsupported RoPE scaling {kind!r}; lrl supports 'default' and 'llama3'")
    return theta, RopeScaling(
        kind="llama3", factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))


def from_hf_dict(hf: dict, **overrides) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture: model_type={model_type!r} "
                         f"(architectures={hf.get('architectures')}); lrl supports "
                         f"{SUPPORTED_MODEL_TYPES}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act={act!r}; lrl supports 'silu'")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    theta, scaling = _rope_from_hf(hf)
    n_heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    attention_bias = bool(hf.get("attention_bias", False))
    fields = dict(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
        mlp_dim=int(hf["intermediate_size"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        # Qwen2 always has q/k/v biases; Llama and Qwen3 only with attention_bias.
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type == "llama" and attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def read_json(path: str):
    """A JSON file's contents; one that does not parse is a ValueError naming the file."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


def from_hf_dir(path: str, **overrides) -> ModelConfig:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    return from_hf_dict(read_json(config_path), **overrides)


def to_hf_dict(cfg: ModelConfig) -> dict:
    """The inverse of `from_hf_dict`, for export (transformers 5 field names)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[cfg.model_type]
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.kind == "llama3":
        s = cfg.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings)
    out = dict(
        architectures=[arch], model_type=cfg.model_type, vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim, hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=32768,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=(list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                      else cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
    )
    if rope["rope_type"] != "default":
        out["rope_scaling"] = dict(rope)
    if cfg.model_type == "llama":
        out.update(attention_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias)
    if cfg.model_type == "qwen3":
        out.update(attention_bias=cfg.qkv_bias)
    return out


def tiny_config(**overrides) -> ModelConfig:
    """A model small enough for CPU tests."""
    return ModelConfig(**overrides)
