"""One block of attention that also yields its log-sum-exp: the kernel under ring attention.

Four entries:
- `merge`: two blocks' (o, lse) into one, by their log-sum-exp.
- `attention_with_lse`: any mask of the form "same segment AND kv_index <= q_index" given by
  arrays (global token indices, so a causal mask works for any pair of blocks). XLA only.
- `block_attention` / `block_attention_bwd`: the ring's per-block forward and backward, with
  the mask named ("causal" on the diagonal, "full" off it) so that cuDNN can run it on GPU.
  The backward takes the *global* output and log-sum-exp, as flash-attention backward does.
- `dense_attention`: whole-sequence causal packed attention (the model's "dense" path).

The XLA path is blockwise: an online softmax over key chunks inside a loop over query chunks,
so the largest score tensor is [B, K, Q, Cq, Ck]; chunk pairs that the mask hides entirely
are skipped. Accumulation is in float32. Rows that see no key give o = 0, lse = -inf, and
zero gradients, never NaN.

cuDNN (GPU, bf16/fp16) comes through `lrl.models.flash_cudnn`, the one module that touches
jax's private cuDNN attention; when it is missing or the shapes do not suit it,
`implementation=None` falls back to XLA.

B batch rows · T query positions · S key/value positions · N query heads · K key/value heads ·
H head dim · Q query heads per kv head · E segments per row. Cq, Ck: a query and a key chunk's
positions.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lrl.models import flash_cudnn as fc

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
    for name, x in (("lse", lse), ("delta", delta)):  # [B, N, T] -> [nq, B, K, Q, Cq]
        if x is not None:
            x = _pad_axis1(jnp.moveaxis(x, 2, 1), cq, 0)           # [B, Tp, N]
            x = _chunked(x.reshape(B, x.shape[1], K, N // K), cq)   # [nq, B, Cq, K, Q]
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
        q_c, qseg_c, qidx_c = args                       # [B, Cq, K, Q, H], [B, Cq], [B, Cq]
        stat = jnp.zeros((B, K, N // K, cq), jnp.float32)
        init = (stat - jnp.inf, stat, jnp.zeros((B, K, N // K, cq, H), jnp.float32))

        def step(carry, kv):
            k_c, v_c, kseg_c, kidx_c = kv

            def update(carry):
                m, l, acc = carry
                s = jnp.einsum("btkqh,bskh->bkqts", q_c, k_c,
                               preferred_element_type=jnp.float32) * scale
                s = jnp.where(_visible(qseg_c, qidx_c, kseg_c, kidx_c), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                # A row that has seen nothing yet keeps max -inf; shift it by 0 instead.
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(m - m_safe)
                pv = jnp.einsum("bkqts,bskh->bkqth", p.astype(v_c.dtype), v_c,
                                preferred_element_type=jnp.float32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            seen = _may_see(qseg_c, qidx_c, kseg_c, kidx_c)
            return lax.cond(seen, update, lambda c: c, carry), None

        (m, l, acc), _ = lax.scan(step, init, (x["k"], x["v"], x["kseg"], x["kidx"]))
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        lse = jnp.where(seen, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(l_safe), -jnp.inf)
        return acc / l_safe[..., None], lse

    o, lse = lax.map(one_q_chunk, (x["q"], x["qseg"], x["qidx"]))  # [nq,B,K,Q,Cq,H], [nq,B,K,Q,Cq]
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
                s = jnp.einsum("btkqh,bskh->bkqts", q_c, k_c,
                               preferred_element_type=jnp.float32) * scale
                vis = _visible(qseg_c, qidx_c, kseg_c, kidx_c)
                p = jnp.where(vis, jnp.exp(s - lse_c[..., None]), 0.0)
                dv_c = dv_c + jnp.einsum("bkqts,btkqh->bskh", p.astype(do_c.dtype), do_c,
                                         preferred_element_type=jnp.float32)
                dp = jnp.einsum("btkqh,bskh->bkqts", do_c, v_c,
                                preferred_element_type=jnp.float32)
                ds = (p * (dp - delta_c[..., None]) * scale).astype(q_c.dtype)
                dq_c = dq_c + jnp.einsum("bkqts,bskh->btkqh", ds, k_c,
                                         preferred_element_type=jnp.float32)
                dk_c = dk_c + jnp.einsum("bkqts,btkqh->bskh", ds, q_c,
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
    # Named as the cuDNN path names them, so remat policies treat both kernels alike.
    o, lse = checkpoint_name(o, "attn_out"), checkpoint_name(lse, "attn_lse")
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


# ----------------------------------------------------------------------------- choice of kernel

def _pick(implementation, q, k, *, need_bwd, where, xla_only=False):
    """"xla" or "cudnn". Forcing "cudnn" where it cannot run here (backend, dtype, head dim)
    is an error; a mask cuDNN cannot express (`xla_only`) quietly takes the XLA path."""
    if implementation not in (None, "xla", "cudnn"):
        raise ValueError(f"{where}: implementation={implementation!r}; use None, 'xla' or 'cudnn'")
    if implementation == "xla":
        return "xla"
    why = fc.unavailable_reason(q, k, need_bwd=need_bwd)
    if implementation == "cudnn" and why is not None:
        raise ValueError(f"{where}: cuDNN requested but unusable: {why}")
    return "xla" if why or xla_only else "cudnn"


# ----------------------------------------------------------------------------- ring entries

def merge(o_a, lse_a, o_b, lse_b):
    """Online-softmax merge of two partial attentions over disjoint keys (o [B,T,N,H] f32,
    lse [B,N,T]); rows unseen by both stay (0, -inf)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    ref = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a = jnp.moveaxis(jnp.exp(lse_a - ref), 1, 2)[..., None]   # [B, T, N, 1]
    w_b = jnp.moveaxis(jnp.exp(lse_b - ref), 1, 2)[..., None]
    return o_a * w_a + o_b * w_b, lse


def _shared_tail(q_seg, kv_seg):
    """For a block whose keys all precede its queries, with segments that are contiguous
    runs: only the last key's segment can be shared, so the visible pairs are the leading
    `a` queries x the trailing `b` keys. -> (a [B], b [B]) int32."""
    last = kv_seg[:, -1:]
    a = jnp.cumprod(q_seg == last, axis=1).sum(1)
    b = jnp.cumprod((kv_seg == last)[:, ::-1], axis=1).sum(1)
    return a.astype(jnp.int32), b.astype(jnp.int32)


def _roll_rows(x, shift_B):
    """Per-row left rotation along axis 1: out[:, j] = x[:, (j + shift) % S]."""
    S = x.shape[1]
    idx = (jnp.arange(S)[None] + shift_B[:, None]) % S
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *(1,) * (x.ndim - 2)), axis=1)


def _block_args(q, k, v, mask_kind, q_seg, kv_seg, where):
    _check_qkv(q, k, v)
    T, S = q.shape[1], k.shape[1]
    if mask_kind not in MASK_KINDS or (mask_kind == "causal" and T != S):
        raise ValueError(f"{where}: mask_kind={mask_kind!r} with T={T}, S={S}; choose one of "
                         f"{MASK_KINDS} ('causal' needs T == S)")
    segmented = q_seg is not None or kv_seg is not None
    if segmented and (q_seg is None or kv_seg is None):
        raise ValueError(f"{where}: give both q_segment_ids and kv_segment_ids, or neither")
    # cuDNN's packed layout gives one set of runs to queries and keys alike, so a causal block
    # with segments goes there only with the very same ids (a ring's diagonal block), else XLA
    return segmented, segmented and mask_kind == "causal" and q_seg is not kv_seg


def _xla_masks(q, k, mask_kind, q_seg, kv_seg):
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    causal = mask_kind == "causal"
    return _as_masks(B, T, S, q_seg, kv_seg, jnp.arange(T) if causal else None,
                     jnp.arange(S) if causal else None)


def block_attention(q_BTNH, k_BSKH, v_BSKH, *, mask_kind, q_segment_ids=None,
                    kv_segment_ids=None, scale=None, implementation=None, out_dtype=None,
                    q_chunk=512, kv_chunk=512, max_segments=64):
    """The ring's block forward -> (o [B,T,N,H], lse [B,N,T] float32).

    mask_kind "causal": key position <= query position within the block (T == S; a ring's
    diagonal block, whose local order follows the global order); "full": every key precedes
    every query. Both also require equal segment ids when given. On cuDNN, segments must be
    contiguous runs (as packing makes them): a "full" block then sees only the trailing run
    of keys x the leading run of queries of the last key's segment, which cuDNN's padding
    mask expresses once the keys are rotated; a segmented causal block (equal ids for queries
    and keys) is cuDNN's packed layout, at most `max_segments` runs per row (NaN beyond).
    """
    segmented, xla_only = _block_args(q_BTNH, k_BSKH, v_BSKH, mask_kind, q_segment_ids,
                                      kv_segment_ids, "block_attention")
    H = q_BTNH.shape[3]
    scale = float(H ** -0.5 if scale is None else scale)
    out_dtype = q_BTNH.dtype if out_dtype is None else out_dtype
    impl = _pick(implementation, q_BTNH, k_BSKH, need_bwd=True, where="block_attention",
                 xla_only=xla_only)
    if impl == "xla":
        masks = _xla_masks(q_BTNH, k_BSKH, mask_kind, q_segment_ids, kv_segment_ids)
        o, lse = _flash_fwd(q_BTNH, k_BSKH, v_BSKH, masks, scale, q_chunk, kv_chunk)
        return o.astype(out_dtype), lse
    if not segmented:
        o, lse = fc.fwd(q_BTNH, k_BSKH, v_BSKH, causal=mask_kind == "causal", scale=scale)
        return o.astype(out_dtype), lse
    if mask_kind == "causal":
        runs = fc.PackedRuns.of(q_segment_ids, max_segments)
        o, stats = fc.fwd(q_BTNH, k_BSKH, v_BSKH, causal=True, scale=scale, **runs.kwargs)
        return runs.nan_where_too_many(o).astype(out_dtype), runs.stats_to_tokens(stats)
    a, b = _shared_tail(q_segment_ids, kv_segment_ids)
    shift = k_BSKH.shape[1] - b
    # an empty rectangle still gets one (masked-out) pair: cuDNN is not asked for length 0
    o, lse = fc.fwd(q_BTNH, _roll_rows(k_BSKH, shift), _roll_rows(v_BSKH, shift),
                    causal=False, scale=scale, q_len=jnp.maximum(a, 1), kv_len=jnp.maximum(b, 1))
    seen_BT = (jnp.arange(q_BTNH.shape[1])[None] < a[:, None]) & (b[:, None] > 0)
    o = jnp.where(seen_BT[:, :, None, None], o, 0).astype(out_dtype)
    return o, jnp.where(seen_BT[:, None, :], lse, -jnp.inf)


def block_attention_bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BNT, do_BTNH, *, mask_kind,
                        q_segment_ids=None, kv_segment_ids=None, scale=None,
                        implementation=None, q_chunk=512, kv_chunk=512, max_segments=64):
    """The ring's block backward -> (dq, dk, dv) float32, given the whole attention's output
    `o_BTNH` and log-sum-exp `lse_BNT` (not the block's own) and the output cotangent."""
    segmented, xla_only = _block_args(q_BTNH, k_BSKH, v_BSKH, mask_kind, q_segment_ids,
                                      kv_segment_ids, "block_attention_bwd")
    H = q_BTNH.shape[3]
    scale = float(H ** -0.5 if scale is None else scale)
    impl = _pick(implementation, q_BTNH, k_BSKH, need_bwd=True, where="block_attention_bwd",
                 xla_only=xla_only)
    if impl == "xla":
        masks = _xla_masks(q_BTNH, k_BSKH, mask_kind, q_segment_ids, kv_segment_ids)
        return _flash_bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BNT, do_BTNH, masks, scale,
                          q_chunk, kv_chunk)
    f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
    if not segmented:
        return f32(*fc.bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, lse_BNT, do_BTNH,
                           causal=mask_kind == "causal", scale=scale))
    if mask_kind == "causal":
        runs = fc.PackedRuns.of(q_segment_ids, max_segments)
        return f32(*fc.bwd(q_BTNH, k_BSKH, v_BSKH, o_BTNH, runs.tokens_to_stats(lse_BNT),
                           do_BTNH, causal=True, scale=scale, **runs.kwargs))
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    a, b = _shared_tail(q_segment_ids, kv_segment_ids)
    shift = S - b
    seen_BT = (jnp.arange(T)[None] < a[:, None]) & (b[:, None] > 0)
    # zero cotangent outside the rectangle: whatever cuDNN does there contributes nothing
    do = jnp.where(seen_BT[:, :, None, None], do_BTNH, 0)
    lse = jnp.where(jnp.isfinite(lse_BNT), lse_BNT, 0.0)
    dq, dk, dv = f32(*fc.bwd(q_BTNH, _roll_rows(k_BSKH, shift), _roll_rows(v_BSKH, shift),
                             o_BTNH, lse, do, causal=False, scale=scale,
                             q_len=jnp.maximum(a, 1), kv_len=jnp.maximum(b, 1)))
    key_seen = (jnp.arange(S)[None] < b[:, None]) & (a[:, None] > 0)
    dk, dv = (jnp.where(key_seen[:, :, None, None], g, 0) for g in (dk, dv))
    return (jnp.where(seen_BT[:, :, None, None], dq, 0),
            _roll_rows(dk, -shift), _roll_rows(dv, -shift))


# ----------------------------------------------------------------------------- dense entry

# Runs (packed sequences) a row may hold in cuDNN's packed layout as lrl calls it at most;
# the packer of update rows (`lrl.grpo.pack`) never puts more in a row than its model config's
# `max_segments` (this, or fewer for long rows: `segments_for`).
MAX_SEGMENTS = 64
# cuDNN's packed backward sizes its buffers as if each of a row's E runs were the whole row:
# E x T x N x H of fp32 dQ and of bf16 dK and dV (GQA's heads expanded), 8 bytes a (run,
# token, query feature), whatever the runs hold. At 64 runs that was 0.75 MiB a token for
# Qwen2.5-1.5B's heads (24 GiB for one 32K-token row, measured: docs/benchmark-history.md, "Seventeenth
# session"), so a long row gets fewer runs: at most this many bytes a row.
PACKED_ROW_BYTES = 4 << 30


def segments_for(row_len: int, n_heads: int, head_dim: int, least: int = 2) -> int:
    """E, the runs a row of `row_len` tokens may hold on cuDNN's packed attention: as many
    as keep the packed backward's buffers within `PACKED_ROW_BYTES` a row, between `least`
    (what one unit of packing needs: a sequence, or a shared group, and the padding) and
    `MAX_SEGMENTS`."""
    E = PACKED_ROW_BYTES // (8 * max(1, row_len) * n_heads * head_dim)
    return int(max(2, least, min(MAX_SEGMENTS, E)))


def dense_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, *, implementation=None,
                    scale=None, max_segments=MAX_SEGMENTS, q_chunk=512, kv_chunk=512):
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
    impl = _pick(implementation, q_BTNH, k_BSKH, need_bwd=False, where="dense_attention")
    if impl == "cudnn":
        return fc.dense_causal(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, scale=scale,
                               max_segments=max_segments)
    index = jnp.arange(T)
    masks = _as_masks(B, T, T, segment_ids_BT, segment_ids_BT, index, index)
    return _flash(q_BTNH, k_BSKH, v_BSKH, masks, scale, int(q_chunk), int(kv_chunk))[0]
