"""The Qwen2.5-VL policy: visual embeddings spliced into the token embeddings, multimodal
rotary positions (M-RoPE), then lrl's own decoder layers.

Parameters are `{"text": <an lrl decoder tree, the same names as lrl.models.init_params>,
"vision": <lrl.models.vision tree>}`, so `lrl.rl` and `lrl.rollout` work on `params["text"]`.

Visual embeddings enter a forward as one table [R, D] plus a per-token index [B, T] into it
(-1 for text tokens). The G samples of a prompt all point at the same table rows, which is how
an embedding computed once (`lrl.models.embed_cache`) serves every rollout sample and the
policy and reference forwards.

M-RoPE positions are [3, B, T] (temporal, height, width). Text tokens have three equal
components that continue one past the largest position so far; a visual item of grid
(t, h, w) (in merged tokens) gets (st + ⌊i·interval⌋, st + row, st + col), with
interval = tokens_per_second × seconds per temporal patch for videos and 0 for images. This is
Qwen2.5-VL's original rule (transformers ≤ 5.2, vLLM); transformers 5.3+ restarts the text
after a video at st + max(h, w), which differs when the temporal span is the longest.

On a mesh (MR-SP stage 2) a packed multimodal row is split along T over `seq` like a text
row: tokens, visual index and segment ids [B, T] and positions [3, B, T] all split on T
(`constrain_positions`, `batch_shardings`), the table is replicated, and with ring attention
the integer inputs are put in the ring's zig-zag order before the embedding lookup.

B batch rows · T query positions · D model width · V vocabulary · R visual table rows ·
E segments per row (indexed by segment id).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lrl import mesh as mesh_lib
from lrl.models.config import ModelConfig
from lrl.models.decoder import Decoder, constrain, default_positions, logits_from_hidden
from lrl.models.forward import ring_layout, unembedding
from lrl.models.vision import VisionConfig


@dataclasses.dataclass(frozen=True)
class VLConfig:
    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    def __post_init__(self):
        if not self.text.mrope_section:
            raise ValueError("VLConfig: the text config needs mrope_section")
        if self.vision.out_hidden_size != self.text.d_model:
            raise ValueError(f"VLConfig: vision out_hidden_size={self.vision.out_hidden_size} "
                             f"!= text d_model={self.text.d_model}")

    @property
    def vision_token_ids(self) -> tuple[int, int]:
        return (self.image_token_id, self.video_token_id)

    def tokens_per_item(self, grid_thw) -> int:
        t, h, w = (int(g) for g in grid_thw)
        return t * h * w // self.vision.merge_unit

    def replace(self, **kw) -> "VLConfig":
        return dataclasses.replace(self, **kw)


# ----------------------------------------------------------------------------- positions

def mrope_positions(vl_cfg: VLConfig, tokens_T, image_grids: Sequence = (),
                    video_grids: Sequence = (), video_seconds_per_grid: Optional[Sequence] = None):
    """M-RoPE positions [3, T] (int32) of one sequence and its rope delta (an int).

    Image / video grids (t, h, w in patches, as the processor reports them) are consumed in
    order of appearance. A generated token at index j (past the prompt) has position j + delta
    in all three components, which is what the rollout's decode positions must be.
    """
    tokens_T = np.asarray(tokens_T)
    m = vl_cfg.vision.spatial_merge_size
    tps = vl_cfg.vision.tokens_per_second
    grids = {vl_cfg.image_token_id: list(image_grids), vl_cfg.video_token_id: list(video_grids)}
    seconds = list(video_seconds_per_grid if video_seconds_per_grid is not None
                   else [1.0] * len(video_grids))
    if len(seconds) != len(grids[vl_cfg.video_token_id]):
        raise ValueError(f"mrope_positions: {len(seconds)} seconds-per-grid values for "
                         f"{len(grids[vl_cfg.video_token_id])} videos")
    used = {vl_cfg.image_token_id: 0, vl_cfg.video_token_id: 0}
    out, i, nxt, T = [], 0, 0, len(tokens_T)
    while i < T:
        tok = int(tokens_T[i])
        if tok not in used:
            j = i
            while j < T and int(tokens_T[j]) not in used:
                j += 1
            out.append(np.broadcast_to(np.arange(nxt, nxt + j - i), (3, j - i)))
            nxt += j - i
            i = j
            continue
        kind = "image" if tok == vl_cfg.image_token_id else "video"
        k = used[tok]
        if k >= len(grids[tok]):
            raise ValueError(f"mrope_positions: more {kind} placeholders than the "
                             f"{len(grids[tok])} {kind} grids given")
        t, h, w = (int(g) for g in grids[tok][k])
        lt, lh, lw = t, h // m, w // m
        n = lt * lh * lw
        if i + n > T or np.any(tokens_T[i:i + n] != tok):
            raise ValueError(f"mrope_positions: {kind} {k} of grid {(t, h, w)} needs {n} "
                             f"consecutive placeholder tokens at index {i}")
        interval = np.float32(0.0) if kind == "image" else np.float32(seconds[k]) * np.float32(tps)
        t_idx = (np.arange(lt, dtype=np.float32) * interval).astype(np.int64)
        tt, hh, ww = np.meshgrid(t_idx, np.arange(lh), np.arange(lw), indexing="ij")
        pos = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + nxt
        out.append(pos)
        nxt = int(pos.max()) + 1
        used[tok] = k + 1
        i += n
    for tok, k in used.items():
        if k != len(grids[tok]):
            raise ValueError(f"mrope_positions: {len(grids[tok])} grids given for token id {tok} "
                             f"but the sequence has {k} such items")
    positions = np.concatenate(out, axis=1).astype(np.int32) if out else np.zeros((3, 0), np.int32)
    return positions, nxt - T


def extend_positions(positions_3T, delta: int, length: int) -> np.ndarray:
    """A prompt's positions extended to `length` tokens: token j past the prompt is text
    (whatever id the policy sampled) at j + delta in all three components."""
    positions_3T = np.asarray(positions_3T)
    tail = np.arange(positions_3T.shape[1], length) + delta
    return np.concatenate([positions_3T, np.broadcast_to(tail, (3, len(tail)))],
                          axis=1).astype(np.int32)


def text_positions_3(tokens_BT, segment_ids_BT=None, offset_B=None):
    """[3, B, T] positions for text-only rows (three equal components), plus an optional
    per-row offset (a rope delta)."""
    pos = default_positions(jnp.asarray(tokens_BT), segment_ids_BT)
    if offset_B is not None:
        pos = pos + jnp.asarray(offset_B, pos.dtype)[:, None]
    return jnp.broadcast_to(pos, (3,) + pos.shape)


# ----------------------------------------------------------------------------- visual index

def visual_index(vl_cfg: VLConfig, tokens_BT, segment_ids_BT=None, offsets_BE=None,
                 counts_BE=None):
    """Host-side [B, T] int32 index into the visual table (-1 for text tokens).

    The k-th placeholder of segment s of row b reads table row `offsets_BE[b, s] + k`, for
    k < `counts_BE[b, s]` (the prompt's visual token count): placeholder ids the policy happens
    to sample in a completion stay ordinary tokens. Without segment ids each row is segment 1;
    without offsets, rows read consecutive table rows in row-major order (transformers'
    masked_scatter order).
    """
    tokens_BT = np.asarray(tokens_BT)
    is_vis = np.isin(tokens_BT, vl_cfg.vision_token_ids)
    if offsets_BE is None:
        idx = np.cumsum(is_vis.ravel()).reshape(is_vis.shape) - 1
        return np.where(is_vis, idx, -1).astype(np.int32)
    seg = np.ones_like(tokens_BT) if segment_ids_BT is None else np.asarray(segment_ids_BT)
    offsets_BE = np.asarray(offsets_BE)
    out = np.full(tokens_BT.shape, -1, np.int32)
    for b in range(tokens_BT.shape[0]):
        for s in np.unique(seg[b][is_vis[b]]):
            where = np.nonzero(is_vis[b] & (seg[b] == s))[0]
            if counts_BE is not None:
                where = where[:int(counts_BE[b, s])]
            if len(where) and offsets_BE[b, s] < 0:
                raise ValueError(f"visual_index: row {b} segment {s} has {len(where)} visual "
                                 "tokens but no table offset")
            out[b, where] = offsets_BE[b, s] + np.arange(len(where))
    return out


# ----------------------------------------------------------------------------- forward

def embed_tokens(cfg: ModelConfig, text_params, tokens_BT, visual_table_RD=None,
                 visual_index_BT=None):
    """Token embeddings with visual rows spliced in where `visual_index_BT >= 0`."""
    x = jnp.take(text_params["embed"]["embedding"], jnp.asarray(tokens_BT, jnp.int32),
                 axis=0).astype(cfg.dtype)
    if visual_table_RD is None:
        return x
    idx = jnp.asarray(visual_index_BT, jnp.int32)
    vis = jnp.take(visual_table_RD.astype(cfg.dtype), jnp.maximum(idx, 0), axis=0)
    return jnp.where((idx >= 0)[..., None], vis, x)


def constrain_positions(positions, mesh):
    """Positions [B, T] or [3, B, T] laid out like the activations: rows over (data, fsdp),
    T over seq; the three M-RoPE components stay together on every device."""
    if mesh is None:
        return positions
    if positions.ndim == 2:
        return constrain(positions, mesh)
    spec = P(None, *mesh_lib.batch_spec(mesh, 2))
    return jax.lax.with_sharding_constraint(positions, NamedSharding(mesh, spec))


def batch_shardings(mesh, batch) -> dict:
    """Shardings of an update batch (`lrl.rl.update`) on `mesh`: [B, T] arrays with rows over
    (data, fsdp) and T over seq, M-RoPE positions [B, 3, T] with T over seq as well."""
    out = {}
    for k, v in batch.items():
        if k == "positions" and np.ndim(v) == 3:
            spec = mesh_lib.batch_spec(mesh, 2)
            out[k] = NamedSharding(mesh, P(spec[0], None, spec[1]))
        else:
            out[k] = mesh_lib.batch_sharding(mesh, np.ndim(v))
    return out


def _decoder_layers(cfg: ModelConfig, text_params, x_BTD, positions, segment_ids_BT, mesh,
                    prefix_ids_BT=None):
    """lrl's decoder layers and final norm on embeddings already in the attention's layout."""
    def run(module, x, pos, seg, pre):
        return module.layers_and_norm(constrain(x, mesh), pos, seg, pre)

    return Decoder(cfg, mesh).apply({"params": text_params}, x_BTD, positions, segment_ids_BT,
                                    prefix_ids_BT, method=run)


def hidden_from_embeddings(cfg: ModelConfig, text_params, x_BTD, positions, segment_ids_BT,
                           mesh=None):
    """lrl's decoder layers and final norm on given input embeddings. `positions` is [B, T] or
    [3, B, T]; inputs and outputs are in natural token order (ring layout handled here)."""
    layout = ring_layout(cfg, mesh, x_BTD.shape[1])
    if layout is not None:
        perm = layout[0]
        x_BTD = jnp.take(x_BTD, perm, axis=1)
        positions = jnp.take(positions, perm, axis=positions.ndim - 1)
        segment_ids_BT = jnp.take(segment_ids_BT, perm, axis=1)
    x = _decoder_layers(cfg, text_params, x_BTD, constrain_positions(positions, mesh),
                        segment_ids_BT, mesh)
    return x if layout is None else jnp.take(x, layout[1], axis=1)


def vl_hidden_states(cfg: ModelConfig, text_params, tokens_BT, positions=None,
                     segment_ids_BT=None, visual_table_RD=None, visual_index_BT=None, mesh=None,
                     prefix_ids_BT=None):
    """Final-normalised hidden states [B, T, D] of a multimodal batch, in natural token order.

    `cfg` is the text config (`vl_cfg.text`); positions default to text positions (all three
    components equal), which is right only for rows without visual tokens. On a mesh with
    ring attention, tokens, visual index, positions and segment ids are permuted into the
    zig-zag layout BEFORE the embedding lookup (integers move instead of [B, T, D] rows); the
    lookup itself is local: the visual table is replicated and the index is split like the
    tokens. `prefix_ids_BT`: rows in the shared-prompt layout (`lrl.data.shared_prompt`).
    """
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    if segment_ids_BT is None:
        segment_ids_BT = jnp.ones_like(tokens_BT)
    segment_ids_BT = jnp.asarray(segment_ids_BT, jnp.int32)
    if positions is None:
        positions = default_positions(tokens_BT, segment_ids_BT)
    positions = jnp.asarray(positions, jnp.int32)
    if visual_index_BT is not None:
        visual_index_BT = jnp.asarray(visual_index_BT, jnp.int32)
    if prefix_ids_BT is not None:
        prefix_ids_BT = jnp.asarray(prefix_ids_BT, jnp.int32)
    layout = ring_layout(cfg, mesh, tokens_BT.shape[1])
    if layout is not None:
        perm = layout[0]
        tokens_BT, segment_ids_BT = (jnp.take(a, perm, axis=1) for a in (tokens_BT,
                                                                         segment_ids_BT))
        positions = jnp.take(positions, perm, axis=positions.ndim - 1)
        if visual_index_BT is not None:
            visual_index_BT = jnp.take(visual_index_BT, perm, axis=1)
        if prefix_ids_BT is not None:
            prefix_ids_BT = jnp.take(prefix_ids_BT, perm, axis=1)
    if mesh is not None:
        tokens_BT, segment_ids_BT = constrain(tokens_BT, mesh), constrain(segment_ids_BT, mesh)
        if visual_index_BT is not None:
            visual_index_BT = constrain(visual_index_BT, mesh)
        if prefix_ids_BT is not None:
            prefix_ids_BT = constrain(prefix_ids_BT, mesh)
    x = embed_tokens(cfg, text_params, tokens_BT, visual_table_RD, visual_index_BT)
    x = _decoder_layers(cfg, text_params, x, constrain_positions(positions, mesh),
                        segment_ids_BT, mesh, prefix_ids_BT)
    return x if layout is None else jnp.take(x, layout[1], axis=1)


def batch_hidden_states(cfg: ModelConfig, text_params, batch, visual_table_RD, mesh=None,
                        packed: bool = True):
    """`vl_hidden_states` of a packed update batch (`lrl.rl.update`'s `hidden` for the video
    task): M-RoPE positions [B, 3, T], `visual_index` [B, T] into `visual_table_RD`, the
    frozen vision tower's output, which gets no gradient. Rows always carry segment ids, and
    `prefix_ids` when they are in the shared-prompt layout."""
    del packed
    if visual_table_RD is None:
        raise ValueError("update: a vision-language batch needs the visual table as the step's "
                         "extra argument")
    return vl_hidden_states(cfg, text_params, batch["tokens"],
                            jnp.swapaxes(batch["positions"], 0, 1), batch["segment_ids"],
                            jax.lax.stop_gradient(visual_table_RD), batch["visual_index"], mesh,
                            batch.get("prefix_ids"))


def vl_forward(cfg: ModelConfig, text_params, tokens_BT, positions=None, segment_ids_BT=None,
               visual_table_RD=None, visual_index_BT=None, mesh=None):
    """float32 logits [B, T, V]; for long rows use `vl_hidden_states` and chunked log-probs."""
    x = vl_hidden_states(cfg, text_params, tokens_BT, positions, segment_ids_BT,
                         visual_table_RD, visual_index_BT, mesh)
    return logits_from_hidden(x, unembedding(cfg, text_params))


def visual_table_hf_order(vl_cfg: VLConfig, tokens_BT, image_embeds=(), video_embeds=()):
    """Table and index in transformers' order: image placeholders (row-major over the batch)
    take the image embeddings in order, video placeholders the video embeddings."""
    tokens_BT = np.asarray(tokens_BT)
    tables = [e for e in list(image_embeds) + list(video_embeds)]
    is_img = tokens_BT == vl_cfg.image_token_id
    is_vid = tokens_BT == vl_cfg.video_token_id
    n_img = sum(int(e.shape[0]) for e in image_embeds)
    n_vid = sum(int(e.shape[0]) for e in video_embeds)
    if is_img.sum() != n_img or is_vid.sum() != n_vid:
        raise ValueError(f"visual tokens do not match the features: {int(is_img.sum())} image "
                         f"placeholders for {n_img} image embeddings, {int(is_vid.sum())} video "
                         f"placeholders for {n_vid} video embeddings")
    img_idx = np.cumsum(is_img.ravel()).reshape(is_img.shape) - 1
    vid_idx = np.cumsum(is_vid.ravel()).reshape(is_vid.shape) - 1 + n_img
    index = np.where(is_img, img_idx, np.where(is_vid, vid_idx, -1)).astype(np.int32)
    table = jnp.concatenate(tables, axis=0) if tables else None
    return table, index
