"""One block of attention that also yields its log-sum-exp: the kernel under ring attention.

Three entries:
- `attention_with_lse`: any mask of the form "same segment AND kv_index <= q_index" given by
  arrays (global token indices, so a causal mask works for any pair of blocks). XLA only.
- `block_attention` / `block_attention_bwd`: the ring's per-block forward and backward, with
  the mask named ("causal" on the diagonal, "full" off it) so that cuDNN can run it on GPU.
  The backward takes the *global* output and log-sum-exp, as flash-attention backward does.
- `dense_attention`: whole-sequence causal packed attention (the model's "dense" path).

The XLA path is blockwise: an online softmax over key chunks inside a loop over query chunks,
so the largest score tensor is [B, K, G, Cq, Ck]; chunk pairs that the mask hides entirely
are skipped. Accumulation is in float32. Rows that see no key give o = 0, lse = -inf, and
zero gradients, never NaN.

cuDNN (GPU, bf16/fp16) comes from jax's private `jax._src.cudnn.fused_attention_stablehlo`,
imported in this file only and guarded: when it is missing or the shapes do not suit it,
`implementation=None` falls back to XLA.

B batch · T query positions · S key/value positions · N query heads · K kv heads · H head dim ·
G query heads per kv head · C chunk · M segments per row.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # private jax module: keep every use of it in this file
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except Exception:  # pragma: no cover - depends on the jax build
    _cudnn = None

_PAD_Q_INDEX = -1                      # a padded query row sees nothing
_PAD_KV_INDEX = np.iinfo(np.int32).max  # a padded key is seen by nothing
MASK_KINDS = ("causal", "full")


# ----------------------------------------------------------------------------- XLA path

def _pad_axis1(x, multiple, value):
    pad = (-x.shape[1]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _chunked(x, c):
    """[B, T, ...] -> [T // c, B, c, ...] (T already a multiple of c)."""
    B, T = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, T // c, c, *x.shape[2:]), 1, 0)


def _prepare(q, k, v, masks, cq, ck, do=None, lse=None, delta=None):
    """Pads T and S to chunk multiples (pads are masked by index) and splits into chunks."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qseg, kseg, qidx, kidx = masks
    q5 = _pad_axis1(q.reshape(B, T, K, N // K, H), cq, 0)
    out = dict(
        q=_chunked(q5, cq), k=_chunked(_pad_axis1(k, ck, 0), ck),
        v=_chunked(_pad_axis1(v, ck, 0), ck),
        qseg=_chunked(_pad_axis1(qseg, cq, 0), cq), kseg=_chunked(_pad_axis1(kseg, ck, 0), ck),
        qidx=_chunked(_pad_axis1(qidx, cq, _PAD_Q_INDEX), cq),
        kidx=_chunked(_pad_axis1(kidx, ck, _PAD_KV_INDEX), ck))
    if do is not None:
        out["do"] = _chunked(_pad_axis1(do.reshape(B, T, K, N // K, H), cq, 0), cq)
    for name, x in (("lse", lse), ("delta", delta)):  # [B, N, T] -> [nq, B, K, G, Cq]
        if x is not None:
            x = _pad_axis1(jnp.moveaxis(x, 2, 1), cq, 0)           # [B, Tp, N]
            x = _chunked(x.reshape(B, x.shape[1], K, N // K), cq)   # [nq, B, Cq, K, G]
            out[name] = jnp.moveaxis(x, 2, 4)
    return out


def _visible(qseg, qidx, kseg, kidx):
    """[B, Cq] x [B, Ck] -> [B, 1, 1, Cq, Ck]: same segment and key not after query."""
    vis = (qseg[:, :, None] == kseg[:, None, :]) & (kidx[:, None, :] <= qidx[:, :, None])
    return vis[:, None, None]


def _may_see(qseg, qidx, kseg, kidx):
    """A cheap scalar bound: False only when no query of the chunk can see a key of the chunk."""
    return ((kidx.min() <= qidx.max()) & (kseg.min() <= qseg.max())
            & (qseg.min() <= kseg.max()))


def _flash_fwd(q, k, v, masks, scale, cq, ck):
    """-> (o [B, T, N, H] float32, lse [B, N, T] float32)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    cq, ck = min(cq, T), min(ck, k.shape[1])
    x = _prepare(q, k, v, masks, cq, ck)

    def one_q_chunk(args):
        q_c, qseg_c, qidx_c = args                       # [B, Cq, K, G, H], [B, Cq], [B, Cq]
        stat = jnp.zeros((B, K, N // K, cq), jnp.float32)
        init = (stat - jnp.inf, stat, jnp.zeros((B, K, N // K, cq, H), jnp.float32))

        def step(carry, kv):
            k_c, v_c, kseg_c, kidx_c = kv

            def update(carry):
                m, l, acc = carry
                s = jnp.einsum("bqkgh,bskh->bkgqs", q_c, k_c,
                               preferred_element_type=jnp.float32) * scale
                s = jnp.where(_visible(qseg_c, qidx_c, kseg_c, kidx_c), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                # A row that has seen nothing yet keeps max -inf; shift it by 0 instead.
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(m - m_safe)
                pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v_c.dtype), v_c,
                                preferred_element_type=jnp.float32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            seen = _may_see(qseg_c, qidx_c, kseg_c, kidx_c)
            return lax.cond(seen, update, lambda c: c, carry), None

        (m, l, acc), _ = lax.scan(step, init, (x["k"], x["v"], x["kseg"], x["kidx"]))
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        lse = jnp.where(seen, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(l_safe), -jnp.inf)
        return acc / l_safe[..., None], lse

    o, lse = lax.map(one_q_chunk, (x["q"], x["qseg"], x["qidx"]))  # [nq,B,K,G,Cq,H], [nq,B,K,G,Cq]
    Tp = o.shape[0] * cq
    o = jnp.transpose(o, (1, 0, 4, 2, 3, 5)).reshape(B, Tp, N, H)[:, :T]
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(B, N, Tp)[:, :, :T]
    return o, lse


def _flash_bwd(q, k, v, o, lse, do, masks, scale, cq, ck, dlse=None):
    """Gradients (float32) of o (and of lse, when `dlse` is given) wrt q, k, v.

    `o` and `lse` are those of the whole attention the block belongs to (for ring attention:
    the combined output over all blocks), which is what makes per-block gradients add up.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    cq, ck = min(cq, T), min(ck, S)
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))
    if dlse is not None:  # d lse / d s = p, so an lse cotangent just shifts delta
        delta = delta - dlse.astype(jnp.float32)
    x = _prepare(q, k, v, masks, cq, ck, do=do, lse=lse, delta=delta)
    lse_safe = jnp.where(jnp.isfinite(x["lse"]), x["lse"], 0.0)

    def kv_step(dq_all, kv):
        k_c, v_c, kseg_c, kidx_c = kv

        def q_step(dkv, xs):
            q_c, do_c, lse_c, delta_c, qseg_c, qidx_c, dq_c = xs

            def update(args):
                dk_c, dv_c, dq_c = args
                s = jnp.einsum("bqkgh,bskh->bkgqs", q_c, k_c,
                               preferred_element_type=jnp.float32) * scale
                vis = _visible(qseg_c, qidx_c, kseg_c, kidx_c)
                p = jnp.where(vis, jnp.exp(s - lse_c[..., None]), 0.0)
                dv_c = dv_c + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(do_c.dtype), do_c,
                                         preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgh,bskh->bkgqs", do_c, v_c,
                                preferred_element_type=jnp.float32)
                ds = (p * (dp - delta_c[..., None]) * scale).astype(q_c.dtype)
                dq_c = dq_c + jnp.einsum("bkgqs,bskh->bqkgh", ds, k_c,
                                         preferred_element_type=jnp.float32)
                dk_c = dk_c + jnp.einsum("bkgqs,bqkgh->bskh", ds, q_c,
                                         preferred_element_type=jnp.float32)
                return dk_c, dv_c, dq_c

            seen = _may_see(qseg_c, qidx_c, kseg_c, kidx_c)
            dk_c, dv_c, dq_c = lax.cond(seen, update, lambda a: a, (*dkv, dq_c))
            return (dk_c, dv_c), dq_c

        zeros = jnp.zeros((B, ck, K, H), jnp.float32)
        (dk_c, dv_c), dq_all = lax.scan(
            q_step, (zeros, zeros),
            (x["q"], x["do"], lse_safe, x["delta"], x["qseg"], x["qidx"], dq_all))
        return dq_all, (dk_c, dv_c)

    dq0 = jnp.zeros(x["q"].shape, jnp.float32)
    dq, (dk, dv) = lax.scan(kv_step, dq0, (x["k"], x["v"], x["kseg"], x["kidx"]))
    unchunk = lambda a, n: jnp.moveaxis(a, 0, 1).reshape(B, -1, *a.shape[3:])[:, :n]
    return unchunk(dq, T).reshape(B, T, N, H), unchunk(dk, S), unchunk(dv, S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, masks, scale, cq, ck):
    o, lse = _flash_fwd(q, k, v, masks, scale, cq, ck)
    return o.astype(q.dtype), lse


def _flash_vjp_fwd(q, k, v, masks, scale, cq, ck):
    o, lse = _flash(q, k, v, masks, scale, cq, ck)
    return (o, lse), (q, k, v, masks, o, lse)


def _flash_vjp_bwd(scale, cq, ck, res, cts):
    q, k, v, masks, o, lse = res
    do, dlse = cts
    dq, dk, dv = _flash_bwd(q, k, v, o, lse, do, masks, scale, cq, ck, dlse=dlse)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_vjp_fwd, _flash_vjp_bwd)


def _check_qkv(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"attention: q must be [B,T,N,H] and k, v equal [B,S,K,H]; got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: q {q.shape} and k {k.shape} disagree on rows or head "
                         f"dim, or N={q.shape[2]} query heads do not divide by K={k.shape[2]}")


def _as_masks(B, T, S, q_seg, kv_seg, q_idx, kv_idx):
    """Materialises the four int32 mask arrays; a missing index means no causal mask."""
    def fill(x, n, value):
        return (jnp.full((B, n), value, jnp.int32) if x is None
                else jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B, n)))
    return (fill(q_seg, T, 0), fill(kv_seg, S, 0), fill(q_idx, T, 0), fill(kv_idx, S, 0))


def attention_with_lse(q_BTNH, k_BSKH, v_BSKH, *, q_segment_ids_BT, kv_segment_ids_BS,
                       q_index_BT, kv_index_BS, scale=None, implementation=None,
                       q_chunk=512, kv_chunk=512):
    """One block of attention with mask (same segment AND kv_index <= q_index).

    Segment ids or indices may be None (one segment / no causal mask); indices are
    non-negative. Returns (o [B,T,N,H] in q's dtype, lse [B,N,T] float32), differentiable in
    both. Arbitrary index masks have no cuDNN form, so this is always the XLA path.
    """
    _check_qkv(q_BTNH, k_BSKH, v_BSKH)
    if implementation not in (None, "xla"):
        raise ValueError(f"attention_with_lse: implementation={implementation!r}; index-array "
                         "masks run on XLA only; use block_attention for cuDNN")
    B, T, _, H = q_BTNH.shape
    masks = _as_masks(B, T, k_BSKH.shape[1], q_segment_ids_BT, kv_segment_ids_BS,
                      q_index_BT, kv_index_BS)
    scale = float(H ** -0.5 if scale is None else scale)
    return _flash(q_BTNH, k_BSKH, v_BSKH, masks, scale, int(q_chunk), int(kv_chunk))


# ----------------------------------------------------------------------------- cuDNN path

def _cudnn_bwd_binder():
    """Binds cuDNN's backward primitive by parameter name, so the call survives the
    argument lists of different jax versions; None when this jax has no such primitive."""
    try:
        impl = _cudnn._dot_product_attention_bwd_impl
        wrapper = _cudnn._dot_product_attention_bwd_p_wrapper
        names = list(inspect.signature(impl).parameters)
        split = names.index("grad_output") + 1
    except Exception:
        return None
    known_operands = {"query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets",
                      "kv_offsets", "page_table_k", "page_table_v", "activation",
                      "fwd_output", "grad_output"}
    known_params = {"scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
                    "sliding_window_length"}
    if not (set(names[:split]) <= known_operands and set(names[split:]) <= known_params):
        return None

    def bwd(q, k, v, o, lse, do, *, causal, scale):
        empty = jnp.zeros(0, q.dtype)
        operands = dict(query=q, key=k, value=v, activation=lse, fwd_output=o, grad_output=do)
        mask = _cudnn.MaskType.CAUSAL if causal else _cudnn.MaskType.NO_MASK
        params = dict(scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False),
                      mask_type=mask, layout=_cudnn.AttentionLayout.BTNH.value,
                      sliding_window_length=None)
        args = [operands.get(n, empty) for n in names[:split]]
        return wrapper.bind(*args, **{n: params[n] for n in names[split:]})[:3]
    return bwd


_CUDNN_BWD = None if _cudnn is None else _cudnn_bwd_binder()


def cudnn_unavailable_reason(q, k, *, need_bwd=False) -> str | None:
    """None when cuDNN flash attention can run these shapes here, else why not."""
    if _cudnn is None:
        return "this jax has no jax._src.cudnn.fused_attention_stablehlo"
    if need_bwd and _CUDNN_BWD is None:
        return "this jax's cuDNN backward primitive has an unknown signature"
    if jax.default_backend() != "gpu":
        return f"backend is {jax.default_backend()}, not gpu"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"cuDNN needs bf16/fp16, got q {q.dtype}, k {k.dtype}"
    H = q.shape[-1]
    if H % 8 or H > 128:
        return f"head dim {H} (cuDNN here: a multiple of 8, at most 128)"
    return None


def _pick(implementation, q, k, *, need_bwd, segmented, where):
    if implementation not in (None, "xla", "cudnn"):
        raise ValueError(f"{where}: implementation={implementation!r}; use None, 'xla' or 'cudnn'")
    if implementation == "xla":
        return "xla"
    why = cudnn_unavailable_reason(q, k, need_bwd=need_bwd)
    if why is None and segmented:
        why = "segment ids: cuDNN's packed layout is used by dense_attention only"
    if implementation == "cudnn" and why is not None:
        raise ValueError(f"{where}: cuDNN requested but unusable: {why}")
    return "xla" if why else "cudnn"


# ----------------------------------------------------------------------------- ring entries

def block_attention(q_BTNH, k_BSKH, v_BSKH, *, mask_kind, q_segment_ids=None,
                    kv_segment_ids=None, scale=None, implementation=None, out_dtype=None,
                    q_chunk=512, kv_chunk=512):
    """The ring's block forward -> (o [B,T,N,H], lse [B,N,T] float32).

    mask_kind "causal": key position <= query position within the block (T == S; a ring's
    diagonal block, whose local order follows the global order); "full": every key precedes
    every query. Both also require equal segment ids when they are given. cuDNN runs the
    unsegmented case on GPU; segmented blocks take the XLA path.
    """
    _check_qkv(q_BTNH, k_BSKH, v_BSKH)
    B, T, _, H = q_BTNH.shape
    S = k_BSKH.shape[1]
    if mask_kind not in MASK_KINDS or (mask_kind == "causal" and T != S):
        raise ValueError(f"block_attention: mask_kind={mask_kind!r} with T={T}, S={S}; "
                         f"choose one of {MASK_KINDS} ('causal' needs T == S)")
    scale = float(H ** -0.5 if scale is None else scale)
    out_dtype = q_BTNH.dtype if out_dtype is None else out_dtype
    segmented = q_segment_ids is not None or kv_segment_ids is not None
    impl = _pick(implementation, q_BTNH, k_BSKH, need_bwd=True, segmented=segmented,
                 where="block_attention")
    if impl == "cudnn":
        mask = _cudnn.MaskType.CAUSAL if mask_kind == "causal" else _cudnn.MaskType.NO_MASK
        o, lse = _cudnn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, scale=scale,
                                              mask_type=mask, qkv_layout="BTNH",
                                              return_residual=True)
        return o.astype(out_dtype), lse.astype(jnp.float32)
    causal = mask_kind == "causal"
    masks = _as_masks(B, T, S, q_segment_ids, kv_segment_ids,
                      jnp.arange(T) if causal else None, jnp.arange(S) if causal else None)
    o, lse = _flash_fwd(q_BTNH, k_BSKH, v_BSKH, masks, scale, q_chunk, kv_chunk)
    return o.astype(out_dtype), lse


def block_attention_bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BNT, do_BTNH, *, mask_kind,
                        q_segment_ids=None, kv_segment_ids=None, scale=None,
                        implementation=None, q_chunk=512, kv_chunk=512):
    """The ring's block backward -> (dq, dk, dv) float32, given the whole attention's output
    `o_BTNH` and log-sum-exp `lse_BNT` (not the block's own) and the output cotangent."""
    _check_qkv(q_BTNH, k_BSKH, v_BSKH)
    B, T, _, H = q_BTNH.shape
    S = k_BSKH.shape[1]
    if mask_kind not in MASK_KINDS or (mask_kind == "causal" and T != S):
        raise ValueError(f"block_attention_bwd: mask_kind={mask_kind!r} with T={T}, S={S}")
    scale = float(H ** -0.5 if scale is None else scale)
    segmented = q_segment_ids is not None or kv_segment_ids is not None
    impl = _pick(implementation, q_BTNH, k_BSKH, need_bwd=True, segmented=segmented,
                 where="block_attention_bwd")
    if impl == "cudnn":
        dt = q_BTNH.dtype
        grads = _CUDNN_BWD(q_BTNH, k_BSKH, v_BSKH, o_BTNH.astype(dt), lse_BNT.astype(jnp.float32),
                           do_BTNH.astype(dt), causal=mask_kind == "causal", scale=scale)
        return tuple(g.astype(jnp.float32) for g in grads)
    causal = mask_kind == "causal"
    masks = _as_masks(B, T, S, q_segment_ids, kv_segment_ids,
                      jnp.arange(T) if causal else None, jnp.arange(S) if causal else None)
    return _flash_bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BNT, do_BTNH, masks, scale,
                      q_chunk, kv_chunk)


# ----------------------------------------------------------------------------- dense entry

def segment_runs(segment_ids_BT, max_segments):
    """Contiguous runs of equal ids -> (offsets [B, M+1], lengths [B, M], count [B]) in the
    form of cuDNN's packed layout (unused slots -1). Ids must form one run per segment."""
    B, T = segment_ids_BT.shape
    seg = segment_ids_BT.astype(jnp.int32)
    start_BT = jnp.concatenate([jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    count_B = start_BT.sum(1).astype(jnp.int32)
    starts = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments + 1, fill_value=T)[0])(start_BT)
    starts = starts.astype(jnp.int32)
    slot = jnp.arange(max_segments + 1)[None]
    offsets = jnp.where(slot < count_B[:, None], starts, -1)
    lengths = jnp.where(slot[:, :-1] < count_B[:, None], starts[:, 1:] - starts[:, :-1], -1)
    return offsets, lengths.astype(jnp.int32), count_B


def dense_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, implementation=None,
                    scale=None, max_segments=64, q_chunk=512, kv_chunk=512):
    """Whole-sequence causal attention within segments (segment_ids_BT may be None) -> o.

    cuDNN (GPU): without segment ids a plain causal kernel; with them cuDNN's packed layout
    (offsets and lengths of each run, at most `max_segments` runs per row; a row with more
    gives NaN rather than a silently wrong answer). XLA: the blockwise kernel.
    """
    _check_qkv(q_BTNH, k_BSKH, v_BSKH)
    B, T, _, H = q_BTNH.shape
    if k_BSKH.shape[1] != T:
        raise ValueError(f"dense_attention: q has T={T}, k has S={k_BSKH.shape[1]}")
    scale = float(H ** -0.5 if scale is None else scale)
    impl = _pick(implementation, q_BTNH, k_BSKH, need_bwd=False, segmented=False,
                 where="dense_attention")
    if impl == "cudnn":
        if segment_ids_BT is None:
            return _cudnn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, scale=scale,
                                                mask_type=_cudnn.MaskType.CAUSAL,
                                                qkv_layout="BTNH")
        if max_segments < 2:
            raise ValueError(f"dense_attention: max_segments={max_segments}; cuDNN's packed "
                             "layout needs at least 2")
        offsets, lengths, count_B = segment_runs(segment_ids_BT, max_segments)
        o = _cudnn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, None, None, lengths, lengths,
                                         offsets, offsets, scale=scale,
                                         mask_type=_cudnn.MaskType.PADDING_CAUSAL,
                                         qkv_layout="BTNH")
        too_many = (count_B > max_segments)[:, None, None, None]
        return jnp.where(too_many, jnp.nan, o).astype(q_BTNH.dtype)
    index = jnp.arange(T)
    masks = _as_masks(B, T, T, segment_ids_BT, segment_ids_BT, index, index)
    return _flash(q_BTNH, k_BSKH, v_BSKH, masks, scale, int(q_chunk), int(kv_chunk))[0]
