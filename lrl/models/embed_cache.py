"""MR-SP stage 1: every prompt's visual embeddings are computed once and then only read.

The G rollout samples of a prompt, and the policy and reference forwards of the update, all
index one visual table [R, D] (`lrl.models.vl`), so the vision tower runs once per prompt
however large G is. Encoding splits frames over the mesh: items with the same patch grid are
concatenated along frames, padded to a multiple of the devices, cut into fixed-size chunks (one
compilation per grid) and encoded with frames sharded over `frame_axes`.

`EmbeddingCache` keeps embeddings in memory and, given a directory, on disk (one .npy per
item), keyed by a hash of the video's path, mtime and size, the frame settings and a model id:
epochs after the first skip decoding and encoding. The vision tower is frozen in this scheme
(cached embeddings carry no gradient to it).

Items are anything with `.patches` [t·h·w, A], `.grid_thw` (t, h, w) and `.source` (a path or "")
— e.g. `lrl.data.video.VisualItem`.

B batch rows: frames, in the vision tower · T a frame's patches · A a patch row's pixel values ·
D model width · R visual table rows · P prompts · G samples per prompt · E segments per row.
"""
from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lrl.models import vision as vision_lib
from lrl.models.vision import VisionConfig

Encoder = Callable[[object, np.ndarray, tuple], jax.Array]


def make_encoder(vcfg: VisionConfig, mesh=None, frame_axes: Optional[Sequence[str]] = None,
                 frame_chunk: int = 16) -> Encoder:
    """encoder(vision_params, patches [B, T, A], (grid_h, grid_w)) -> [B, T / m², D].

    Frames are split over `frame_axes` (default: every mesh axis) and run `frame_chunk` per
    device at a time, so memory is bounded and a grid compiles once.
    """
    axes = tuple(a for a in (frame_axes or (mesh.axis_names if mesh is not None else ()))
                 if mesh.shape[a] > 1) if mesh is not None else ()
    n_dev = math.prod(mesh.shape[a] for a in axes) if axes else 1
    chunk = frame_chunk * n_dev
    frames_spec = (NamedSharding(mesh, PartitionSpec(axes or None, None, None))
                   if mesh is not None else None)
    compiled = {}

    def get_fn(grid_hw):
        if grid_hw not in compiled:
            def run(params, patches):
                return vision_lib.encode_frames(vcfg, params, patches, grid_hw, mesh, axes)
            compiled[grid_hw] = jax.jit(run, out_shardings=frames_spec)
        return compiled[grid_hw]

    def encoder(params, patches_BTA, grid_hw):
        grid_hw = (int(grid_hw[0]), int(grid_hw[1]))
        B = patches_BTA.shape[0]
        # Fewer frames than one chunk: shrink the chunk to the next multiple of the devices.
        step = min(chunk, -(-B // n_dev) * n_dev)
        padded = -(-B // step) * step
        patches = np.asarray(patches_BTA, np.float32)
        if padded != B:
            patches = np.concatenate([patches, np.zeros((padded - B,) + patches.shape[1:],
                                                        patches.dtype)])
        fn = get_fn(grid_hw)
        put = (lambda x: jax.device_put(x, frames_spec)) if mesh is not None else jnp.asarray
        outs = [fn(params, put(patches[i:i + step])) for i in range(0, padded, step)]
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
        return out[:B]
    return encoder


def encode_items(vcfg: VisionConfig, params, items: Sequence, encoder: Encoder) -> list:
    """[n_i, D] embeddings per item (n_i = t·h·w / m²), one encoder call per patch grid."""
    groups: dict[tuple, list[int]] = {}
    for i, it in enumerate(items):
        t, h, w = (int(g) for g in it.grid_thw)
        if it.patches.shape != (t * h * w, vcfg.patch_dim):
            raise ValueError(f"visual item {i} ({it.source or 'in memory'}): patches "
                             f"{it.patches.shape} do not fit grid {it.grid_thw}")
        groups.setdefault((h, w), []).append(i)
    out = [None] * len(items)
    for (h, w), idx in groups.items():
        frames = np.concatenate([np.asarray(items[i].patches).reshape(-1, h * w, vcfg.patch_dim)
                                 for i in idx])
        emb = encoder(params, frames, (h, w))
        start = 0
        for i in idx:
            t = int(items[i].grid_thw[0])
            out[i] = emb[start:start + t].reshape(-1, emb.shape[-1])
            start += t
    return out


def item_key(item, settings_fingerprint: str, model_id: str) -> str:
    """Hash of the source file (path, mtime, size) or, for in-memory pixels, of the pixels;
    plus the frame settings and the model."""
    h = hashlib.sha256()
    if item.source and os.path.isfile(item.source):
        st = os.stat(item.source)
        h.update(f"{os.path.abspath(item.source)}|{st.st_mtime_ns}|{st.st_size}".encode())
    else:
        h.update(np.ascontiguousarray(item.patches).tobytes())
    h.update(f"|{tuple(int(g) for g in item.grid_thw)}|{settings_fingerprint}|{model_id}".encode())
    return h.hexdigest()[:32]


class EmbeddingCache:
    """Embeddings by key: in device memory (up to `max_items` and `max_bytes`, least recently
    used dropped: a 64-frame video's table is 117 MB at Qwen2.5-VL-7B's width, so a dataset of
    a few hundred videos would fill an H200) and, if `directory` is given, as `<key>.npy` files
    shared between epochs and runs."""

    def __init__(self, directory: Optional[str] = None, max_items: int = 4096,
                 max_bytes: Optional[int] = None):
        self.directory, self.max_items, self.max_bytes = directory, max_items, max_bytes
        self._mem: OrderedDict[str, jax.Array] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        if directory:
            os.makedirs(directory, exist_ok=True)

    def _file(self, key):
        return os.path.join(self.directory, f"{key}.npy")

    def get(self, key: str):
        if key in self._mem:
            self._mem.move_to_end(key)
            self.hits += 1
            return self._mem[key]
        if self.directory and os.path.isfile(self._file(key)):
            arr = jnp.asarray(np.load(self._file(key)))
            self._remember(key, arr)
            self.hits += 1
            return arr
        self.misses += 1
        return None

    def contains(self, key: str) -> bool:
        """Whether `get(key)` would hit (counts neither a hit nor a miss)."""
        return key in self._mem or bool(self.directory and os.path.isfile(self._file(key)))

    def put(self, key: str, emb) -> None:
        self._remember(key, emb)
        if self.directory:
            tmp = f"{self._file(key)}.tmp{os.getpid()}.npy"
            np.save(tmp, np.asarray(jax.device_get(emb), np.float32))
            os.replace(tmp, self._file(key))

    def _remember(self, key, emb):
        if key in self._mem:
            self.bytes -= _nbytes(self._mem[key])
        self._mem[key] = emb
        self._mem.move_to_end(key)
        self.bytes += _nbytes(emb)
        while self._mem and (len(self._mem) > self.max_items or (
                self.max_bytes is not None and self.bytes > self.max_bytes)):
            self.bytes -= _nbytes(self._mem.popitem(last=False)[1])


def _nbytes(x) -> int:
    return int(x.size) * x.dtype.itemsize


def prompt_embeddings(vcfg: VisionConfig, params, prompts_items: Sequence[Sequence],
                      encoder: Encoder, cache: Optional[EmbeddingCache] = None,
                      settings_fingerprint: str = "", model_id: str = "") -> list:
    """Per prompt, its items' embeddings concatenated in order of appearance [n_p, D].

    Only items missing from `cache` are encoded (all in one `encode_items` call)."""
    flat = [it for items in prompts_items for it in items]
    keys = ([item_key(it, settings_fingerprint, model_id) for it in flat] if cache is not None
            else [None] * len(flat))
    found = [cache.get(k) if cache is not None else None for k in keys]
    todo = [i for i, f in enumerate(found) if f is None]
    if todo:
        for i, emb in zip(todo, encode_items(vcfg, params, [flat[i] for i in todo], encoder)):
            found[i] = emb
            if cache is not None:
                cache.put(keys[i], emb)
    out, start = [], 0
    for items in prompts_items:
        embs = found[start:start + len(items)]
        start += len(items)
        out.append(jnp.concatenate(embs, axis=0) if embs else None)
    return out


def build_table(per_prompt: Sequence, width: int, dtype=jnp.float32, pad_to: int = 1):
    """One table [R, D] of all prompts' rows and each prompt's first row (-1 if it has none).
    R is padded up to a multiple of `pad_to` (fewer recompilations across steps)."""
    offsets, parts, n = [], [], 0
    for emb in per_prompt:
        if emb is None or emb.shape[0] == 0:
            offsets.append(-1)
            continue
        offsets.append(n)
        parts.append(emb.astype(dtype))
        n += emb.shape[0]
    R = max(pad_to, -(-max(n, 1) // pad_to) * pad_to)
    parts.append(jnp.zeros((R - n, width), dtype))
    return jnp.concatenate(parts, axis=0), np.asarray(offsets, np.int32)


def group_offsets(prompt_offsets, group_size: int, counts=None, segments_per_row: int = 1):
    """Table offsets (and, given each prompt's visual token `counts`, counts) [P·G, 1 + E]
    for rows ordered prompt-major (row p·G + g is sample g of prompt p, segment 1): the
    `offsets_BE` / `counts_BE` that `lrl.models.vl.visual_index` reads. Every sample of a
    prompt points at the same rows."""
    def spread(values, fill):
        per_row = np.repeat(np.asarray(values, np.int32), group_size)
        out = np.full((len(per_row), 1 + segments_per_row), fill, np.int32)
        out[:, 1] = per_row
        return out
    offsets = spread(prompt_offsets, -1)
    return offsets if counts is None else (offsets, spread(counts, 0))
