"""Loading a local Hugging Face Qwen2.5-VL checkpoint into `{"text": ..., "vision": ...}`.

The text half goes through lrl's own HF table (`lrl.models.hf_io`), so its tree is exactly an
lrl decoder's; the vision half is read tensor by tensor into the stacked layout of
`lrl.models.vision`. Both checkpoint spellings are read: the hub's (`model.layers.*`,
`visual.*`) and transformers 4.5x's (`model.language_model.layers.*`, `model.visual.*`).

D model width · F MLP width · L layers (the vision tower's own, in its tree).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from lrl.models import config as config_lib
from lrl.models import hf_io
from lrl.models.vision import VisionConfig, from_hf_vision_dict, vision_param_shapes
from lrl.models.vl import VLConfig

VL_MODEL_TYPES = ("qwen2_5_vl",)


def _text_dict(hf: dict) -> dict:
    """The text fields as a Qwen2 config dict that `config.from_hf_dict` reads."""
    text = dict(hf.get("text_config") or hf)
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if key in hf and key not in text:
            text[key] = hf[key]
    if "tie_word_embeddings" in hf:  # transformers 5 keeps the authoritative value at the root
        text["tie_word_embeddings"] = hf["tie_word_embeddings"] or text.get("tie_word_embeddings")
    rope = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or hf.get("rope_scaling") or {})
    section = rope.get("mrope_section") or scaling.get("mrope_section")
    if not section:
        raise ValueError("Qwen2.5-VL config has no mrope_section (rope_parameters / rope_scaling)")
    theta = rope.get("rope_theta", text.get("rope_theta", hf.get("rope_theta", 1e6)))
    text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": theta},
                rope_scaling=None, mrope_section=[int(s) for s in section])
    return text


def vl_config_from_hf_dict(hf: dict, **text_overrides) -> VLConfig:
    if hf.get("model_type") not in VL_MODEL_TYPES:
        raise ValueError(f"not a vision-language checkpoint lrl reads: model_type="
                         f"{hf.get('model_type')!r} (architectures={hf.get('architectures')}); "
                         f"supported: {VL_MODEL_TYPES}")
    text = _text_dict(hf)
    dtype = text_overrides.get("param_dtype", jnp.float32)
    text_cfg = config_lib.from_hf_dict(
        text, mrope_section=tuple(text["mrope_section"]), **text_overrides)
    vision = from_hf_vision_dict(hf["vision_config"], dtype=text_cfg.dtype, param_dtype=dtype)
    return VLConfig(text=text_cfg, vision=vision,
                    image_token_id=int(hf["image_token_id"]),
                    video_token_id=int(hf["video_token_id"]),
                    vision_start_token_id=int(hf["vision_start_token_id"]),
                    vision_end_token_id=int(hf["vision_end_token_id"]))


class _Renamed:
    """A SafetensorsDir seen under the hub's names (text under `model.`, vision `visual.`)."""

    def __init__(self, st: hf_io.SafetensorsDir):
        self.st, self.path = st, st.path
        self._alias = {}
        for key in st.keys():
            for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
                if key.startswith(new):
                    self._alias[old + key[len(new):]] = key
                    break
            else:
                self._alias[key] = key

    def __contains__(self, key):
        return key in self._alias

    def keys(self):
        return self._alias.keys()

    def get(self, key):
        if key not in self._alias:
            raise KeyError(f"tensor {key!r} is missing from the checkpoint in {self.path!r}")
        return self.st.get(self._alias[key])


def _t(w):
    return np.asarray(w).T


# lrl vision leaf (under "blocks") -> (HF suffix after visual.blocks.{i}., transform)
_VISION_BLOCK = {
    ("norm1", "scale"): ("norm1.weight", np.asarray),
    ("norm2", "scale"): ("norm2.weight", np.asarray),
    ("qkv", "kernel"): ("attn.qkv.weight", _t), ("qkv", "bias"): ("attn.qkv.bias", np.asarray),
    ("proj", "kernel"): ("attn.proj.weight", _t), ("proj", "bias"): ("attn.proj.bias", np.asarray),
    ("gate_proj", "kernel"): ("mlp.gate_proj.weight", _t),
    ("gate_proj", "bias"): ("mlp.gate_proj.bias", np.asarray),
    ("up_proj", "kernel"): ("mlp.up_proj.weight", _t),
    ("up_proj", "bias"): ("mlp.up_proj.bias", np.asarray),
    ("down_proj", "kernel"): ("mlp.down_proj.weight", _t),
    ("down_proj", "bias"): ("mlp.down_proj.bias", np.asarray),
}
_VISION_TOP = {
    ("patch_embed", "kernel"): ("visual.patch_embed.proj.weight",
                                lambda w: np.asarray(w).reshape(w.shape[0], -1).T),
    ("merger", "ln_q", "scale"): ("visual.merger.ln_q.weight", np.asarray),
    ("merger", "fc1", "kernel"): ("visual.merger.mlp.0.weight", _t),
    ("merger", "fc1", "bias"): ("visual.merger.mlp.0.bias", np.asarray),
    ("merger", "fc2", "kernel"): ("visual.merger.mlp.2.weight", _t),
    ("merger", "fc2", "bias"): ("visual.merger.mlp.2.bias", np.asarray),
}


def _vision_leaf(vcfg: VisionConfig, st, names: tuple, shape: tuple) -> np.ndarray:
    if names[0] == "blocks":
        suffix, fn = _VISION_BLOCK[names[1:]]
        arr = np.stack([fn(st.get(f"visual.blocks.{i}.{suffix}")) for i in range(vcfg.depth)])
    else:
        key, fn = _VISION_TOP[names]
        arr = fn(st.get(key))
    if arr.shape != tuple(shape):
        raise ValueError(f"vision tensor for {'/'.join(names)} has shape {arr.shape}, the config "
                         f"implies {tuple(shape)} (checkpoint {st.path!r})")
    return arr


def load_vision(vcfg: VisionConfig, st, dtype, mesh=None):
    """The vision tree, replicated on `mesh` (it is small, and every device encodes frames)."""
    sharding = (NamedSharding(mesh, PartitionSpec()) if mesh is not None
                else SingleDeviceSharding(jax.devices()[0]))
    np_dtype = np.dtype(jnp.dtype(dtype))

    def place(path, shape):
        names = tuple(getattr(k, "key", str(k)) for k in path)
        arr = _vision_leaf(vcfg, st, names, shape).astype(np_dtype)
        return jax.device_put(arr, sharding)
    return jax.tree_util.tree_map_with_path(place, vision_param_shapes(vcfg),
                                            is_leaf=lambda x: isinstance(x, tuple))


def load_hf_vl(path: str, dtype=jnp.float32, mesh=None, **text_overrides):
    """A local HF Qwen2.5-VL directory -> (VLConfig, {"text": ..., "vision": ...}).

    `dtype` is the parameter dtype (and the compute dtype unless overridden); the text half is
    sharded over `mesh` by lrl's rules, the vision half replicated.
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    hf = config_lib.read_json(config_path)
    vl_cfg = vl_config_from_hf_dict(hf, **{"param_dtype": dtype, "dtype": dtype,
                                           **text_overrides})
    cfg = vl_cfg.text
    st = _Renamed(hf_io.SafetensorsDir(path))
    # hf_io's own HF<->lrl table, so the text tree matches lrl text models exactly.
    text = hf_io.load_params(cfg, st, mesh)
    vision = load_vision(vl_cfg.vision, st, vl_cfg.vision.param_dtype, mesh)
    return vl_cfg, {"text": text, "vision": vision}
