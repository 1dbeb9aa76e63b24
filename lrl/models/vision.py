"""The Qwen2.5-VL vision tower as pure functions over a parameter dict.

Pixels arrive patched as the processor writes them (`lrl.data.video`): one row per
(temporal patch × spatial patch), rows of one frame in merge-block order (each group of
`spatial_merge_size²` consecutive rows is one visual token of the language model). The tower
is a transformer over frames (temporal patches) of T patches each: frames are its batch rows,
an ordinary batch axis that can be split over devices:

  patch embedding (the Conv3d with stride = kernel is a matmul over flattened patches) →
  depth × block (RMSNorm, attention with a 2D rotary embedding over (row, column), SwiGLU MLP),
  where most blocks attend within windows of `window_size` pixels and the blocks in
  `fullatt_block_indexes` attend over the whole frame →
  patch merger (RMSNorm, 2×2 neighbours concatenated, MLP) → [B, T / m², D_out], D_out the
  language model's width.

transformers permutes the patches into window order and attends over packed windows
(`cu_seqlens`); attention without a causal mask does not care about order, so here windows are
gathered into padded slots [B, W, slots] (valid patches first) and scattered back, and
nothing else is permuted.

The letters are the decoder's, in the tower's own sizes: B batch rows: frames (in windowed
attention, a frame's windows) · T query positions: a frame's patches (in windowed attention, a
window's slots) · S key/value positions: the same · D the tower's width · F its MLP width ·
N heads · H head dim · L layers (blocks) · W windows per frame · A a patch row's pixel values
(channels × temporal patch × patch²).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int = 2                     # L
    hidden_size: int = 32              # D
    intermediate_size: int = 48        # F
    num_heads: int = 2                 # N
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2        # m
    window_size: int = 56              # pixels per window side
    out_hidden_size: int = 64          # the language model's width
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    tokens_per_second: float = 2.0     # M-RoPE temporal scale (used by lrl.models.vl)
    rms_norm_eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    # None or "xla": masked einsum attention; "cudnn": jax.nn.dot_product_attention's
    # cuDNN kernel (GPU, bf16/fp16).
    attention_impl: Optional[str] = None

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision: hidden_size={self.hidden_size} over num_heads="
                             f"{self.num_heads} must give a head dim divisible by 4")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision: hidden_act={self.hidden_act!r}; lrl supports {ACTIVATIONS}")
        if self.window_units < 1:
            raise ValueError(f"vision: window_size={self.window_size} is smaller than one merged "
                             f"token ({self.spatial_merge_size * self.patch_size} pixels)")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision: fullatt_block_indexes {bad} outside 0..{self.depth - 1}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def window_units(self) -> int:
        """Window side in merged tokens (transformers' vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def replace(self, **kw) -> "VisionConfig":
        return dataclasses.replace(self, **kw)


def from_hf_vision_dict(hf: dict, **overrides) -> VisionConfig:
    """The `vision_config` of a Qwen2.5-VL config.json (transformers 4.x or 5.x names)."""
    rope = dict(hf.get("rope_parameters") or {})
    fields = dict(
        depth=int(hf["depth"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_heads=int(hf["num_heads"]),
        in_channels=int(hf.get("in_channels", hf.get("in_chans", 3))),
        patch_size=int(hf.get("patch_size", hf.get("spatial_patch_size", 14))),
        temporal_patch_size=int(hf.get("temporal_patch_size", 2)),
        spatial_merge_size=int(hf.get("spatial_merge_size", 2)),
        window_size=int(hf.get("window_size", 112)),
        out_hidden_size=int(hf["out_hidden_size"]),
        fullatt_block_indexes=tuple(int(i) for i in hf.get("fullatt_block_indexes", ())),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        hidden_act=hf.get("hidden_act", "silu"),
        tokens_per_second=float(hf.get("tokens_per_second", 2)),
    )
    fields.update(overrides)
    return VisionConfig(**fields)


# ----------------------------------------------------------------------------- host layout

class FrameLayout(NamedTuple):
    """Everything that depends only on a frame's patch grid, computed once on the host."""
    cos_TH: np.ndarray        # float32 rotary cos per patch
    sin_TH: np.ndarray
    gather_WT: np.ndarray     # int32 patch index per window slot; the patch count marks an
                              # empty slot
    lengths_W: np.ndarray     # int32 valid slots per window (valid slots come first)
    inverse_T: np.ndarray     # int32 flat slot (w * slots + s) of each patch


@functools.lru_cache(maxsize=64)
def frame_layout(vcfg: VisionConfig, grid_h: int, grid_w: int) -> FrameLayout:
    m = vcfg.spatial_merge_size
    if grid_h % m or grid_w % m:
        raise ValueError(f"vision: patch grid {grid_h}x{grid_w} is not a multiple of "
                         f"spatial_merge_size={m}")
    T = grid_h * grid_w
    k = np.arange(T)
    unit, within = k // vcfg.merge_unit, k % vcfg.merge_unit
    units_w = grid_w // m
    uh, uw = unit // units_w, unit % units_w
    rows, cols = uh * m + within // m, uw * m + within % m
    # 2D rotary: the first quarter of the frequencies turn with the row, the second with the
    # column; the halves are repeated for rotate_half.
    quarter = vcfg.head_dim // 4
    inv = 1.0 / vcfg.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter))
    half = np.concatenate([rows[:, None] * inv, cols[:, None] * inv], axis=1).astype(np.float32)
    emb = np.concatenate([half, half], axis=1)
    ws = vcfg.window_units
    windows_w = -(-units_w // ws)
    windows = -(-(grid_h // m) // ws) * windows_w
    window_of = (uh // ws) * windows_w + uw // ws
    order = np.argsort(window_of, kind="stable")
    lengths = np.bincount(window_of, minlength=windows).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    slots = ws * ws * vcfg.merge_unit
    rank = np.empty(T, np.int64)
    rank[order] = np.arange(T) - starts[window_of[order]]
    gather = np.full((windows, slots), T, np.int32)
    gather[window_of, rank] = k
    return FrameLayout(np.cos(emb), np.sin(emb), gather, lengths,
                       (window_of * slots + rank).astype(np.int32))


# ----------------------------------------------------------------------------- device math

def _rms_norm(x, scale, eps, dtype):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * x32.astype(dtype)


def _act(name: str, x):
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    return x * jax.nn.sigmoid(1.702 * x)  # quick_gelu


def _dense(x, p, dtype):
    y = jnp.einsum("...d,df->...f", x, p["kernel"].astype(dtype))
    return y + p["bias"].astype(dtype) if "bias" in p else y


def _rope(x_BTNH, cos_TH, sin_TH):
    x = x_BTNH.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_TH[None, :, None, :] + rotated * sin_TH[None, :, None, :]
    return out.astype(x_BTNH.dtype)


def _attention(vcfg: VisionConfig, q_BTNH, k_BSNH, v_BSNH, lengths_B=None):
    """Bidirectional attention; keys at or past `lengths_B` (per batch row) are masked."""
    if vcfg.attention_impl == "cudnn":
        return jax.nn.dot_product_attention(
            q_BTNH, k_BSNH, v_BSNH, query_seq_lengths=lengths_B,
            key_value_seq_lengths=lengths_B, implementation="cudnn")
    if vcfg.attention_impl not in (None, "xla"):
        raise ValueError(f"vision: attention_impl={vcfg.attention_impl!r}; use 'xla' or 'cudnn'")
    S, H = k_BSNH.shape[1], q_BTNH.shape[-1]
    scores = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH,
                        preferred_element_type=jnp.float32) / math.sqrt(H)
    if lengths_B is not None:
        visible = jnp.arange(S)[None, :] < lengths_B[:, None]
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v_BSNH.dtype)
    return jnp.einsum("bnts,bsnh->btnh", weights, v_BSNH, preferred_element_type=jnp.float32
                      ).astype(q_BTNH.dtype)


def _windowed(vcfg: VisionConfig, layout: FrameLayout, q, k, v):
    """Attention within windows: gather into padded slots, attend, scatter back."""
    B, T, N, H = q.shape
    W, slots = layout.gather_WT.shape
    flat = jnp.asarray(layout.gather_WT.reshape(-1))

    def in_slots(x):   # [B, T, N, H] -> [B * W, slots, N, H]
        return jnp.take(x, flat, axis=1, mode="fill", fill_value=0).reshape(B * W, slots, N, H)

    lengths = jnp.tile(jnp.asarray(layout.lengths_W), B)
    out = _attention(vcfg, in_slots(q), in_slots(k), in_slots(v), lengths)
    out = out.reshape(B, W * slots, N, H)
    return jnp.take(out, jnp.asarray(layout.inverse_T), axis=1)


def _block(vcfg: VisionConfig, layout: FrameLayout, x_BTD, p, full):
    dt = vcfg.dtype
    B, T, D = x_BTD.shape
    N, H = vcfg.num_heads, vcfg.head_dim
    h = _rms_norm(x_BTD, p["norm1"]["scale"], vcfg.rms_norm_eps, dt)
    qkv = _dense(h, p["qkv"], dt).reshape(B, T, 3, N, H)
    cos, sin = jnp.asarray(layout.cos_TH), jnp.asarray(layout.sin_TH)
    q, k, v = _rope(qkv[:, :, 0], cos, sin), _rope(qkv[:, :, 1], cos, sin), qkv[:, :, 2]
    attn = jax.lax.cond(full, lambda: _attention(vcfg, q, k, v),
                        lambda: _windowed(vcfg, layout, q, k, v))
    x = x_BTD + _dense(attn.reshape(B, T, D), p["proj"], dt)
    h = _rms_norm(x, p["norm2"]["scale"], vcfg.rms_norm_eps, dt)
    mlp = _act(vcfg.hidden_act, _dense(h, p["gate_proj"], dt)) * _dense(h, p["up_proj"], dt)
    return x + _dense(mlp, p["down_proj"], dt)


def encode_frames(vcfg: VisionConfig, params, patches_BTA, grid_hw: tuple[int, int],
                  mesh=None, frame_axes: Optional[tuple[str, ...]] = None):
    """Vision embeddings [B, T / m², D_out] of B frames sharing one patch grid (grid_h, grid_w).

    `patches_BTA` are the processor's rows of those frames, A = channels × temporal patch ×
    patch². With `mesh`, frames are kept split over `frame_axes` (None: every mesh axis; axes
    of size 1 are ignored), so B must divide by their product. Model code: the caller jits.
    """
    B, T, A = patches_BTA.shape
    if A != vcfg.patch_dim or T != grid_hw[0] * grid_hw[1]:
        raise ValueError(f"vision: patches of shape {patches_BTA.shape} do not fit grid {grid_hw} "
                         f"with patch_dim={vcfg.patch_dim}")
    layout = frame_layout(vcfg, *grid_hw)

    def keep_split(x):
        if mesh is None:
            return x
        names = mesh.axis_names if frame_axes is None else frame_axes
        axes = tuple(a for a in names if mesh.shape[a] > 1)
        spec = PartitionSpec(axes or None, *([None] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    dt = vcfg.dtype
    x = keep_split(jnp.einsum("bta,ad->btd", patches_BTA.astype(dt),
                              params["patch_embed"]["kernel"].astype(dt)))
    full_L = np.isin(np.arange(vcfg.depth), vcfg.fullatt_block_indexes)

    def body(x, xs):
        p, full = xs
        return keep_split(_block(vcfg, layout, x, p, full)), None

    x, _ = jax.lax.scan(body, x, (params["blocks"], jnp.asarray(full_L)))
    mp = params["merger"]
    h = _rms_norm(x, mp["ln_q"]["scale"], vcfg.rms_norm_eps, dt)
    h = h.reshape(B, T // vcfg.merge_unit, vcfg.merge_unit * vcfg.hidden_size)
    h = _dense(jax.nn.gelu(_dense(h, mp["fc1"], dt), approximate=False), mp["fc2"], dt)
    return keep_split(h)


def encode(vcfg: VisionConfig, params, patches, grid_thw: tuple[int, int, int], mesh=None):
    """One image or video, its rows [t·h·w, A] as the processor gives them ->
    [t·h·w / m², D_out]."""
    t, gh, gw = (int(g) for g in grid_thw)
    if patches.shape[0] != t * gh * gw:
        raise ValueError(f"vision: {patches.shape[0]} patch rows for grid_thw={grid_thw} "
                         f"(expected {t * gh * gw})")
    out = encode_frames(vcfg, params, patches.reshape(t, gh * gw, -1), (gh, gw), mesh)
    return out.reshape(-1, out.shape[-1])


# ----------------------------------------------------------------------------- parameters

def vision_param_shapes(vcfg: VisionConfig) -> dict:
    D, F, L, m2 = vcfg.hidden_size, vcfg.intermediate_size, vcfg.depth, vcfg.merge_unit

    def dense(i, o, stacked=True):
        lead = (L,) if stacked else ()
        return {"kernel": lead + (i, o), "bias": lead + (o,)}
    return {
        "patch_embed": {"kernel": (vcfg.patch_dim, D)},
        "blocks": {"norm1": {"scale": (L, D)}, "qkv": dense(D, 3 * D), "proj": dense(D, D),
                   "norm2": {"scale": (L, D)}, "gate_proj": dense(D, F), "up_proj": dense(D, F),
                   "down_proj": dense(F, D)},
        "merger": {"ln_q": {"scale": (D,)}, "fc1": dense(m2 * D, m2 * D, False),
                   "fc2": dense(m2 * D, vcfg.out_hidden_size, False)},
    }


def init_vision_params(vcfg: VisionConfig, rng, stddev: float = 0.02):
    """Random weights (for benchmarks and tests without a checkpoint): norms at one, biases at
    zero, matrices normal(0, stddev)."""
    shapes = vision_param_shapes(vcfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(rng, len(flat))
    leaves = []
    for (path, shape), key in zip(flat, keys):
        name = getattr(path[-1], "key", "")
        if name == "scale":
            leaves.append(jnp.ones(shape, vcfg.param_dtype))
        elif name == "bias":
            leaves.append(jnp.zeros(shape, vcfg.param_dtype))
        else:
            leaves.append((stddev * jax.random.normal(key, shape)).astype(vcfg.param_dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)
