"""Hugging Face checkpoints in and out: safetensors files <-> lrl parameter trees.

Loading reads the safetensors files through memory maps and places every parameter shard by
shard with its target sharding (`jax.make_array_from_callback`), so a model is never held
whole in host memory on top of the file cache. One table (`_LAYER_MAP`) says how each HF
tensor becomes an lrl parameter and back; export uses the same table in reverse.

D model width · F MLP width · V vocabulary · N query heads · K kv heads · H head dim · L layers.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import SingleDeviceSharding

from lrl.models import config as config_lib
from lrl.models.config import ModelConfig
from lrl.models.params import abstract_params, param_shardings

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def _heads(n_attr):
    """HF [n*H, D] projection <-> lrl [D, n, H] kernel."""
    def to_lrl(w, cfg):
        return w.T.reshape(cfg.d_model, getattr(cfg, n_attr), cfg.head_dim)

    def to_hf(w, cfg):
        return w.reshape(cfg.d_model, -1).T
    return to_lrl, to_hf


def _heads_bias(n_attr):
    return (lambda b, cfg: b.reshape(getattr(cfg, n_attr), cfg.head_dim),
            lambda b, cfg: b.reshape(-1))


_ident = (lambda w, cfg: w, lambda w, cfg: w)
_transpose = (lambda w, cfg: w.T, lambda w, cfg: w.T)
_o_proj = (lambda w, cfg: w.T.reshape(cfg.n_heads, cfg.head_dim, cfg.d_model),
           lambda w, cfg: w.reshape(-1, cfg.d_model).T)

# (lrl module, lrl param) inside a scanned layer -> (HF suffix after model.layers.{i}., maps)
_LAYER_MAP: dict[tuple[str, str], tuple[str, tuple[Callable, Callable]]] = {
    ("input_norm", "scale"): ("input_layernorm.weight", _ident),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", _ident),
    ("q_proj", "kernel"): ("self_attn.q_proj.weight", _heads("n_heads")),
    ("q_proj", "bias"): ("self_attn.q_proj.bias", _heads_bias("n_heads")),
    ("k_proj", "kernel"): ("self_attn.k_proj.weight", _heads("n_kv_heads")),
    ("k_proj", "bias"): ("self_attn.k_proj.bias", _heads_bias("n_kv_heads")),
    ("v_proj", "kernel"): ("self_attn.v_proj.weight", _heads("n_kv_heads")),
    ("v_proj", "bias"): ("self_attn.v_proj.bias", _heads_bias("n_kv_heads")),
    ("o_proj", "kernel"): ("self_attn.o_proj.weight", _o_proj),
    ("o_proj", "bias"): ("self_attn.o_proj.bias", _ident),
    ("q_norm", "scale"): ("self_attn.q_norm.weight", _ident),
    ("k_norm", "scale"): ("self_attn.k_norm.weight", _ident),
    ("gate_proj", "kernel"): ("mlp.gate_proj.weight", _transpose),
    ("gate_proj", "bias"): ("mlp.gate_proj.bias", _ident),
    ("up_proj", "kernel"): ("mlp.up_proj.weight", _transpose),
    ("up_proj", "bias"): ("mlp.up_proj.bias", _ident),
    ("down_proj", "kernel"): ("mlp.down_proj.weight", _transpose),
    ("down_proj", "bias"): ("mlp.down_proj.bias", _ident),
}
_TOP_MAP = {
    ("embed", "embedding"): ("model.embed_tokens.weight", _ident),
    ("lm_head",): ("lm_head.weight", _transpose),
    ("final_norm", "scale"): ("model.norm.weight", _ident),
}


# ----------------------------------------------------------------------------- safetensors

class SafetensorsDir:
    """Random access to the tensors of one HF model directory (one file or an index)."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            weight_map = config_lib.read_json(index)["weight_map"]
        elif os.path.isfile(single):
            weight_map = None
        else:
            found = sorted(os.listdir(path)) if os.path.isdir(path) else []
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {path!r} "
                f"(found: {found}); lrl reads safetensors checkpoints only")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._headers = {}
        for name in files:
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"{index} names {name!r}, which is missing")
            self._headers[name] = _read_header(full)
        self._where = {}
        for name, header in self._headers.items():
            for key in header:
                if not key.startswith("__"):
                    self._where[key] = name
        self._maps: dict[str, np.memmap] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self):
        return self._where.keys()

    def get(self, key: str) -> np.ndarray:
        if key not in self._where:
            raise KeyError(f"tensor {key!r} is missing from the checkpoint in {self.path!r}")
        name = self._where[key]
        info = self._headers[name][key]
        if name not in self._maps:
            self._maps[name] = np.memmap(os.path.join(self.path, name), np.uint8, mode="r")
        start, end = info["data_offsets"]
        base = self._headers[name]["__data_start__"]
        dtype = _ST_DTYPES[info["dtype"]]
        raw = self._maps[name][base + start: base + end]
        return raw.view(dtype).reshape(info["shape"])


def _read_header(path: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path!r} is not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path!r} has a corrupt safetensors header: {e}") from e
    header["__data_start__"] = 8 + n
    # A cut file (an interrupted download or copy) would read as empty arrays, and fail far
    # from here on a reshape that names neither the file nor the tensor.
    size = os.path.getsize(path)
    short = sorted((8 + n + info["data_offsets"][1], k) for k, info in header.items()
                   if not k.startswith("__") and 8 + n + info["data_offsets"][1] > size)
    if short:
        raise ValueError(f"{path!r} is {size} bytes, shorter than its header says "
                         f"({short[-1][0]} bytes): the file is truncated; tensor "
                         f"{short[0][1]!r}" + (f" and {len(short) - 1} more lie" if len(short) > 1
                                               else " lies") + " past its end")
    return header


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata=None) -> None:
    header, offset, order = {}, 0, []
    for key, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        header[key] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                       "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        order.append(arr)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in order:
            f.write(arr.tobytes())


# ----------------------------------------------------------------------------- loading

def _leaf_loader(cfg: ModelConfig, st: SafetensorsDir, names: tuple, dtype):
    """A function index -> np.ndarray giving any slice of one lrl parameter."""
    if names[0] == "layers":
        hf_suffix, (to_lrl, _) = _LAYER_MAP[names[1:]]
        keys = [f"model.layers.{i}.{hf_suffix}" for i in range(cfg.n_layers)]
        for k in keys:
            if k not in st:
                raise KeyError(f"tensor {k!r} is missing from the checkpoint in {st.path!r}")

        def load(index):
            layers = range(cfg.n_layers)[index[0]]
            return np.stack([np.asarray(to_lrl(st.get(keys[i]), cfg))[index[1:]]
                             for i in layers]).astype(dtype)
        return load
    hf_key, (to_lrl, _) = _TOP_MAP[names]
    if names == ("lm_head",) and hf_key not in st:
        raise KeyError(f"tensor 'lm_head.weight' is missing from {st.path!r} and "
                       "tie_word_embeddings is false")
    if hf_key not in st:
        raise KeyError(f"tensor {hf_key!r} is missing from the checkpoint in {st.path!r}")
    return lambda index: np.asarray(to_lrl(st.get(hf_key), cfg))[index].astype(dtype)


def load_hf(path: str, dtype=jnp.float32, mesh=None, **overrides):
    """Reads a local HF directory -> (cfg, params); sharded over `mesh` when given.

    `dtype` is the parameter dtype (and the compute dtype unless `overrides` says otherwise).
    """
    cfg = config_lib.from_hf_dir(path, **{"param_dtype": dtype, "dtype": dtype, **overrides})
    return cfg, load_params(cfg, SafetensorsDir(path), mesh)


def load_params(cfg: ModelConfig, st, mesh=None):
    """The decoder's parameter tree read from `st` (anything with `get` / `in` by HF tensor
    name), each array placed shard by shard in its sharding on `mesh` (or on device 0)."""
    shapes = abstract_params(cfg)
    if mesh is not None:
        shardings = param_shardings(cfg, mesh, shapes)
    else:
        one = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    np_dtype = np.dtype(jnp.dtype(cfg.param_dtype))

    def place(path_keys, shape, sharding):
        names = tuple(getattr(k, "key", str(k)) for k in path_keys)
        load = _leaf_loader(cfg, st, names, np_dtype)
        return jax.make_array_from_callback(shape.shape, sharding, load)

    return jax.tree_util.tree_map_with_path(place, shapes, shardings)


# ----------------------------------------------------------------------------- saving

def to_hf_state(cfg: ModelConfig, params, dtype=None) -> dict[str, np.ndarray]:
    """lrl params (any sharding) -> {HF tensor name: host array}, one tensor at a time."""
    out = {}
    dtype = np.dtype(jnp.dtype(dtype)) if dtype is not None else None

    def host(x):
        x = np.asarray(jax.device_get(x))
        return x.astype(dtype) if dtype is not None else x

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path_keys, leaf in flat:
        names = tuple(getattr(k, "key", str(k)) for k in path_keys)
        if names[0] == "layers":
            hf_suffix, (_, to_hf) = _LAYER_MAP[names[1:]]
            stacked = host(leaf)
            for i in range(cfg.n_layers):
                out[f"model.layers.{i}.{hf_suffix}"] = np.ascontiguousarray(to_hf(stacked[i], cfg))
        else:
            hf_key, (_, to_hf) = _TOP_MAP[names]
            out[hf_key] = np.ascontiguousarray(to_hf(host(leaf), cfg))
    return out


def save_hf(cfg: ModelConfig, params, out_dir: str, dtype=None,
            max_shard_bytes: int = 4 << 30) -> list[str]:
    """Writes HF safetensors (sharded with an index above `max_shard_bytes`) and config.json."""
    state = to_hf_state(cfg, params, dtype)
    saved = np.dtype(jnp.dtype(dtype)) if dtype is not None else np.dtype(jnp.dtype(cfg.param_dtype))
    return write_hf_dir(out_dir, state, hf_config(cfg, saved), max_shard_bytes)


def hf_config(cfg: ModelConfig, saved_dtype) -> dict:
    """config.json's contents for `cfg`, saved in `saved_dtype`."""
    hf = config_lib.to_hf_dict(cfg)
    hf["torch_dtype"] = hf["dtype"] = {"float32": "float32", "bfloat16": "bfloat16",
                                       "float16": "float16"}[np.dtype(saved_dtype).name]
    return hf


def write_hf_dir(out_dir: str, state: dict[str, np.ndarray], config: dict,
                 max_shard_bytes: int = 4 << 30) -> list[str]:
    """{HF name: array} and a config dict -> safetensors files (an index above
    `max_shard_bytes`) and config.json in `out_dir`; returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    shards, current, size = [], {}, 0
    for key, arr in state.items():
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = arr
        size += arr.nbytes
    shards.append(current)
    written = []
    if len(shards) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0])
        written.append("model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(out_dir, name), shard)
            weight_map.update({k: name for k in shard})
            written.append(name)
        total = sum(a.nbytes for a in state.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return written
