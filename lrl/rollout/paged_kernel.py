"""Our Pallas (Triton) decode-attention kernel over the paged KV pool, for grouped queries.

A program streams one row's pages block by block with an online softmax, for the query heads
of Kp kv heads (`kv_per_program`) over one kv split. What it does that jax's Pallas GPU paged
attention (`jax.experimental.pallas.ops.gpu.paged_attention`, deprecated in jax 0.11) does
not:
- q enters as the model makes it, [B, N, H], unpadded and unscaled. A program reads its Kp·Q
  rows into a 16-row tile by index, and rows past Kp·Q repeat the last one. jax's kernel wants
  q padded to 16 heads per kv head, and the pad plus the scale was an XLA fusion per layer
  (docs/benchmark-history.md, "Measurements once quoted in the code"). The repeated rows compute the same
  output as the row they repeat and are stored to the same address.
- with Kp > 1 the query heads of several kv heads share the tile (Qwen2.5-1.5B: 2 × 6 rows of
  16, where jax's kernel pads each 6 to 16) and one softmax pass.
- with one kv split, the program writes the normalised output in the model's dtype. jax's
  kernel returns per-split partial sums, which XLA rescales, sums and divides: several more
  small ops per layer.
- the layer's base page index enters as an operand. There is no XLA add of it into the
  [B, Y] page table at every layer.

`fused_decode_attention` starts one step earlier, from the joined qkv projection: it also adds
the bias, applies Qwen3's q/k norm and RoPE and writes the new token's key and value, which
XLA otherwise does in three fusions a layer. It is correct on the H200 but slower there (see
EngineConfig.fused_decode), so it is off by default.

B batch rows · N query heads · K key/value heads · Q query heads per kv head · H head dim ·
J joined projections (the N + 2K heads of qkv) · Y pages per slot · S key/value positions (of
one block) · X kv splits · Z rows of the q tile. Kp, a count, is the kv heads of one program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)   # finite, so exp(mask - max) is 0, not NaN


def _tile_rows(rows: int) -> int:
    """Rows of the q tile: Triton's dot wants at least 16, and a power of two."""
    return max(16, pl.next_power_of_2(rows))


def kv_heads_per_program(n_heads: int, n_kv_heads: int, requested: int = 0) -> int:
    """`requested`, or when 0 the most kv heads whose query heads fit one 16-row tile together
    (at least 1): 2 for Qwen2.5-1.5B (12 query heads over 2 kv heads), 2 for 7B (28 over 4),
    8 for 8 heads without GQA."""
    if requested:
        return requested
    Q = n_heads // n_kv_heads
    Kp = max(1, 16 // Q)
    while n_kv_heads % Kp:
        Kp -= 1
    return Kp


def _rows(g, Q: int, Kp: int):
    """A program's q tile: its rows' query heads (rows past Kp*Q repeat the last real one) and
    which of the program's Kp kv heads each row belongs to."""
    Z = _tile_rows(Kp * Q)
    local_Z = jnp.minimum(jnp.arange(Z), Kp * Q - 1)
    return Z, g * Kp * Q + local_Z, (local_Z // Q)[:, None]


def _attend_pages(scores, values, table_ref, length, base, x, Z: int, H: int, page_size: int,
                  pages_per_block: int, pages_per_split: int):
    """Online softmax over the blocks of split x's pages that hold the row's first `length`
    tokens: scores(pages) -> [Z, S] f32, values(pages, p_ZS) -> [Z, H] f32. -> (o, m, l)."""
    block = pages_per_block * page_size
    first_page = x * pages_per_split
    last_page = jnp.minimum(pl.cdiv(length, page_size), first_page + pages_per_split)
    n_blocks = pl.cdiv(jnp.maximum(last_page - first_page, 0), pages_per_block)

    def body(i, carry):
        o_ZH, m_Z, l_Z = carry
        page0 = first_page + i * pages_per_block
        pages = table_ref[pl.ds(page0, pages_per_block)] + base
        visible_S = page0 * page_size + jnp.arange(block) < length
        s_ZS = jnp.where(visible_S[None, :], scores(pages), _MASK)
        m_new = jnp.maximum(m_Z, s_ZS.max(axis=-1))
        correction = jnp.exp(m_Z - m_new)
        p_ZS = jnp.exp(s_ZS - m_new[:, None])
        return (o_ZH * correction[:, None] + values(pages, p_ZS), m_new,
                l_Z * correction + p_ZS.sum(axis=-1))

    init = (jnp.zeros((Z, H), jnp.float32), jnp.full((Z,), _MASK, jnp.float32),
            jnp.zeros((Z,), jnp.float32))
    return jax.lax.fori_loop(0, n_blocks, body, init)


def _store(out_refs, rows_Z, o_ZH, m_Z, l_Z, split: bool):
    """Partial sums of one split, or the normalised output (zeros for a row with no key)."""
    if split:
        o_ref, m_ref, l_ref = out_refs
        o_ref[rows_Z, :] = o_ZH
        m_ref[rows_Z] = m_Z
        l_ref[rows_Z] = l_Z
    else:
        (o_ref,) = out_refs
        o_ref[rows_Z, :] = (o_ZH / jnp.where(l_Z > 0, l_Z, 1.0)[:, None]).astype(o_ref.dtype)


def _kernel(base_ref, len_ref, table_ref, q_ref, *refs, Q: int, Kp: int,
            pages_per_block: int, pages_per_split: int, scale: float, split: bool):
    """Program (b, g, x): row b, kv heads g*Kp .. g*Kp+Kp-1, split x. Its Kp*Q query rows share
    one tile; row r's scores sum Kp dots, each with the q rows of one kv head kept and the others
    zeroed, so every row sees only its own head's keys; its output row is taken from its own
    head's p @ V."""
    k_refs, v_refs, out_refs = refs[:Kp], refs[Kp:2 * Kp], refs[2 * Kp:]
    b, g, x = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    Z, rows_Z, head_Z1 = _rows(g, Q, Kp)
    q_ZH = (q_ref[rows_Z, :].astype(jnp.float32) * scale).astype(k_refs[0].dtype)
    q_by_head = [jnp.where(head_Z1 == j, q_ZH, jnp.zeros_like(q_ZH)) if Kp > 1 else q_ZH
                 for j in range(Kp)]
    page_size, H = k_refs[0].shape[-2], k_refs[0].shape[-1]
    block = pages_per_block * page_size

    def scores(pages):
        return sum(plgpu.dot(q_by_head[j], k_refs[j][pages].reshape(block, H), trans_b=True)
                   for j in range(Kp))

    def values(pages, p_ZS):
        p_lo = p_ZS.astype(v_refs[0].dtype)
        pv_ZH = plgpu.dot(p_lo, v_refs[0][pages].reshape(block, H))
        for j in range(1, Kp):
            pv_ZH = jnp.where(head_Z1 == j, plgpu.dot(p_lo, v_refs[j][pages].reshape(block, H)),
                              pv_ZH)
        return pv_ZH

    o_ZH, m_Z, l_Z = _attend_pages(scores, values, table_ref, len_ref[b], base_ref[0], x, Z, H,
                                   page_size, pages_per_block, pages_per_split)
    _store(out_refs, rows_Z, o_ZH, m_Z, l_Z, split)


@functools.partial(jax.jit, static_argnames=("pages_per_block", "k_splits", "warps", "stages",
                                             "kv_per_program", "interpret"))
def paged_decode_attention(q_BNH, k_pages, v_pages, table_BY, kv_len_B, layer_base, *,
                           pages_per_block: int = 2, k_splits: int = 1, warps: int = 4,
                           stages: int = 1, kv_per_program: int = 1, interpret: bool = False):
    """One query per row over its first `kv_len_B` cached tokens -> [B, N, H] in q's dtype.

    k_pages, v_pages: [K, L * num_pages, page_size, H]; table_BY holds each row's pages of
    layer 0, `layer_base` (int or int32 scalar) is added to them. `k_splits` splits each row's pages
    over that many programs (a few long rows still fill the GPU); their partial results are
    combined here. `kv_per_program` kv heads share one program (0: `kv_heads_per_program`), so
    their query heads share one 16-row tile and one softmax pass instead of each padding its
    own."""
    B, N, H = q_BNH.shape
    K, pool_pages, page_size, Hk = k_pages.shape
    Y = table_BY.shape[1]
    if Hk != H or N % K:
        raise ValueError(f"q [B, N={N}, H={H}] does not fit pages [K={K}, ..., H={Hk}]")
    Q = N // K
    Kp = _check_launch(N, K, H, page_size, Y, pages_per_block, k_splits, kv_per_program,
                       interpret)
    split = k_splits > 1
    kernel = functools.partial(_kernel, Q=Q, Kp=Kp, pages_per_block=pages_per_block,
                               pages_per_split=Y // k_splits, scale=1.0 / H ** 0.5, split=split)
    head = lambda j: pl.BlockSpec((None, pool_pages, page_size, H),  # noqa: E731
                                  lambda b, g, x: (g * Kp + j, 0, 0, 0))
    whole = lambda shape: pl.BlockSpec(shape, lambda b, g, x: (0,) * len(shape))  # noqa: E731
    in_specs = [whole((1,)), whole((B,)),
                pl.BlockSpec((None, Y), lambda b, g, x: (b, 0)),
                pl.BlockSpec((None, N, H), lambda b, g, x: (b, 0, 0)),
                *(head(j) for j in range(Kp)), *(head(j) for j in range(Kp))]
    out_shape, out_specs = _attention_outputs(B, N, H, k_splits, q_BNH.dtype)
    outs = pl.pallas_call(
        kernel, grid=(B, K // Kp, k_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        name=f"lrl_paged_decode_{pages_per_block}x{page_size}",
    )(jnp.asarray(layer_base, jnp.int32).reshape(1), kv_len_B.astype(jnp.int32),
      table_BY.astype(jnp.int32), q_BNH, *(k_pages,) * Kp, *(v_pages,) * Kp)
    if not split:
        return outs[0]
    return _combine_splits(*outs, q_BNH.dtype)


def _check_launch(N: int, K: int, H: int, page_size: int, Y: int, pages_per_block: int,
                  k_splits: int, kv_per_program: int, interpret: bool) -> int:
    """Checks a decode kernel's launch settings against the shapes -> Kp, kv heads a program."""
    for name, v in (("pages_per_block", pages_per_block), ("head dim", H)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if pages_per_block * page_size < 16 and not interpret:   # the interpreter has no such floor
        raise ValueError(f"a block of {pages_per_block} pages x {page_size} tokens is under "
                         "the 16 tokens Triton's dot needs")
    if Y % (k_splits * pages_per_block):
        raise ValueError(f"pages per row {Y} must be a multiple of k_splits * pages_per_block "
                         f"= {k_splits} * {pages_per_block}")
    Kp = kv_heads_per_program(N, K, kv_per_program)
    if K % Kp:
        raise ValueError(f"kv_per_program {Kp} does not divide the {K} kv heads")
    return Kp


def _attention_outputs(B: int, N: int, H: int, k_splits: int, dtype):
    """(out_shape, out_specs) of the attention: per-split partial sums (o, m, l) in fp32, or
    with one split the normalised [B, N, H] output in `dtype`."""
    if k_splits > 1:
        return ([jax.ShapeDtypeStruct((k_splits, B, N, H), jnp.float32),
                 jax.ShapeDtypeStruct((k_splits, B, N), jnp.float32),
                 jax.ShapeDtypeStruct((k_splits, B, N), jnp.float32)],
                [pl.BlockSpec((None, None, N, H), lambda b, g, x: (x, b, 0, 0)),
                 pl.BlockSpec((None, None, N), lambda b, g, x: (x, b, 0)),
                 pl.BlockSpec((None, None, N), lambda b, g, x: (x, b, 0))])
    return ([jax.ShapeDtypeStruct((B, N, H), dtype)],
            [pl.BlockSpec((None, N, H), lambda b, g, x: (b, 0, 0))])


def _combine_splits(o_XBNH, m_XBN, l_XBN, dtype):
    """The splits' partial sums -> the normalised output (zeros for a row with no key)."""
    w_XBN = jnp.exp(m_XBN - m_XBN.max(axis=0))
    l_BN = (l_XBN * w_XBN).sum(axis=0)
    o_BNH = (o_XBNH * w_XBN[..., None]).sum(axis=0) / jnp.where(l_BN > 0, l_BN, 1.0)[..., None]
    return o_BNH.astype(dtype)


def _fused_kernel(base_ref, len_ref, table_ref, y_ref, *refs, Q: int, Kp: int, N: int, K: int,
                  pages_per_block: int, pages_per_split: int, scale: float, split: bool,
                  k_splits: int, has_bias: bool, has_norm: bool, eps: float):
    """`_kernel` that starts from the qkv projection's output instead of rotated q. Program
    (b, g, x) adds the bias, applies q/k RMSNorm and RoPE to its q rows and to its kv heads'
    new key, attends over the row's cached tokens, adds the new token from registers, and (the
    last split only) writes the new key and value into the pool. Each head is handled as two
    halves of H/2, the halves RoPE rotates into each other; their two dots sum to q . k."""
    it = iter(refs)
    bias_ref = next(it) if has_bias else None
    qn_ref, kn_ref = (next(it), next(it)) if has_norm else (None, None)
    cos_ref, sin_ref, wpage_ref, woff_ref, k_ref, v_ref, *out_refs = it
    out_refs, kout_ref, vout_ref = out_refs[:-2], out_refs[-2], out_refs[-1]
    b, g, x = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    Z, rows_Z, head_Z1 = _rows(g, Q, Kp)
    page_size, H = k_ref.shape[-2], k_ref.shape[-1]
    H2, block = H // 2, pages_per_block * page_size
    lo, hi = pl.ds(0, H2), pl.ds(H2, H2)
    dt, pool_dt, f32 = y_ref.dtype, k_ref.dtype, jnp.float32
    cos, sin = cos_ref[...], sin_ref[...]

    def rotated(rows, norm_ref):
        """Rows of y (an index or an index array) -> their two rotated halves, in y's dtype,
        rounded where Block.rotate rounds."""
        a, c = y_ref[rows, lo].astype(f32), y_ref[rows, hi].astype(f32)
        if has_bias:
            a, c = a + bias_ref[rows, lo].astype(f32), c + bias_ref[rows, hi].astype(f32)
        if has_norm:
            inv = jax.lax.rsqrt(((a * a).sum(-1, keepdims=True) + (c * c).sum(-1, keepdims=True))
                                / H + eps)
            a = norm_ref[lo].astype(dt).astype(f32) * (a * inv).astype(dt).astype(f32)
            c = norm_ref[hi].astype(dt).astype(f32) * (c * inv).astype(dt).astype(f32)
            a, c = a.astype(dt).astype(f32), c.astype(dt).astype(f32)
        return (a * cos - c * sin).astype(dt), (c * cos + a * sin).astype(dt)

    q_halves = [(h.astype(f32) * scale).astype(pool_dt) for h in rotated(rows_Z, qn_ref)]
    q_by_head = [[jnp.where(head_Z1 == j, h, jnp.zeros_like(h)) if Kp > 1 else h
                  for h in q_halves] for j in range(Kp)]
    heads = [g * Kp + j for j in range(Kp)]
    new_k = [[h.astype(pool_dt) for h in rotated(N + hj, kn_ref)] for hj in heads]
    new_v = []
    for hj in heads:
        v = y_ref[N + K + hj, :].astype(f32)
        new_v.append((v + bias_ref[N + K + hj, :].astype(f32) if has_bias else v).astype(pool_dt))

    def scores(pages):
        return sum(plgpu.dot(q_by_head[j][0], k_ref[hj, pages, :, lo].reshape(block, H2),
                             trans_b=True)
                   + plgpu.dot(q_by_head[j][1], k_ref[hj, pages, :, hi].reshape(block, H2),
                               trans_b=True)
                   for j, hj in enumerate(heads))

    def values(pages, p_ZS):
        p_lo = p_ZS.astype(pool_dt)
        pv_ZH = plgpu.dot(p_lo, v_ref[heads[0], pages].reshape(block, H))
        for j in range(1, Kp):
            pv_ZH = jnp.where(head_Z1 == j, plgpu.dot(p_lo, v_ref[heads[j], pages]
                                                      .reshape(block, H)), pv_ZH)
        return pv_ZH

    length = len_ref[b]                       # cached tokens plus the new one; 0: idle slot
    base = base_ref[0]
    o_ZH, m_Z, l_Z = _attend_pages(scores, values, table_ref, jnp.maximum(length - 1, 0), base,
                                   x, Z, H, page_size, pages_per_block, pages_per_split)
    # The new token, in the last split only: its score against every q row, then one more
    # online-softmax step.
    take = (length > 0) & (x == k_splits - 1)
    s_Z = sum((q_by_head[j][0].astype(f32) * new_k[j][0].astype(f32)[None, :]).sum(-1)
              + (q_by_head[j][1].astype(f32) * new_k[j][1].astype(f32)[None, :]).sum(-1)
              for j in range(Kp))
    s_Z = jnp.where(take, s_Z, _MASK)
    m_new = jnp.maximum(m_Z, s_Z)
    correction = jnp.exp(m_Z - m_new)
    p_Z = jnp.where(take, jnp.exp(s_Z - m_new), 0.0)
    v_ZH = jnp.broadcast_to(new_v[0].astype(f32)[None, :], (Z, H))
    for j in range(1, Kp):
        v_ZH = jnp.where(head_Z1 == j, new_v[j].astype(f32)[None, :], v_ZH)
    o_ZH = o_ZH * correction[:, None] + p_Z[:, None] * v_ZH
    _store(out_refs, rows_Z, o_ZH, m_new, l_Z * correction + p_Z, split)

    def write():
        page, offset = wpage_ref[b] + base, woff_ref[b]
        for j, hj in enumerate(heads):
            kout_ref[hj, page, offset, lo] = new_k[j][0]
            kout_ref[hj, page, offset, hi] = new_k[j][1]
            vout_ref[hj, page, offset, :] = new_v[j]
    if k_splits == 1:
        write()
    else:
        pl.when(x == k_splits - 1)(write)


@functools.partial(jax.jit, static_argnames=("n_heads", "eps", "pages_per_block", "k_splits",
                                             "warps", "stages", "kv_per_program", "interpret"))
def fused_decode_attention(y_BJH, bias_JH, q_norm_H, k_norm_H, cos_BH2, sin_BH2, k_pages,
                           v_pages, table_BY, kv_len_B, write_page_B, write_offset_B,
                           layer_base, *, n_heads: int, eps: float, pages_per_block: int = 4,
                           k_splits: int = 1, warps: int = 4, stages: int = 1,
                           kv_per_program: int = 1, interpret: bool = False):
    """One decode step's attention from the qkv projection: -> (out [B, N, H], k_pages,
    v_pages with the new token's key and value written).

    y_BJH is the joined q/k/v projection [B, N + 2K, H] before its bias (`bias_JH` or None);
    `q_norm_H` / `k_norm_H` are Qwen3's per-head RMSNorm scales (or None); cos/sin [B, H/2]
    are the rows' RoPE angles (`rope_angles`, one half: the halves are equal). `kv_len_B`
    counts the cached tokens plus the new one (0: an idle row, which gets zeros);
    `write_page_B` / `write_offset_B` place the new token (pages of layer 0, `layer_base`
    added). What Block.rotate, `write_kv` and `paged_decode_attention` do in three XLA
    fusions and a kernel, here in the kernel: one launch a layer instead of four."""
    B, J, H = y_BJH.shape
    K, pool_pages, page_size, Hk = k_pages.shape
    N = n_heads
    Y = table_BY.shape[1]
    if Hk != H or J != N + 2 * K or N % K:
        raise ValueError(f"qkv [B, J={J}, H={H}] does not fit {N} query heads and pages "
                         f"[K={K}, ..., H={Hk}]")
    if (q_norm_H is None) != (k_norm_H is None):
        raise ValueError("fused_decode_attention: give both q and k norm scales or neither")
    Q = N // K
    Kp = _check_launch(N, K, H, page_size, Y, pages_per_block, k_splits, kv_per_program,
                       interpret)
    split = k_splits > 1
    has_bias, has_norm = bias_JH is not None, q_norm_H is not None
    kernel = functools.partial(
        _fused_kernel, Q=Q, Kp=Kp, N=N, K=K, pages_per_block=pages_per_block,
        pages_per_split=Y // k_splits, scale=1.0 / H ** 0.5, split=split, k_splits=k_splits,
        has_bias=has_bias, has_norm=has_norm, eps=float(eps))
    whole = lambda shape: pl.BlockSpec(shape, lambda b, g, x: (0,) * len(shape))  # noqa: E731
    row = lambda shape: pl.BlockSpec((None, *shape), lambda b, g, x: (b,) + (0,) * len(shape))  # noqa: E731,E501
    operands = [jnp.asarray(layer_base, jnp.int32).reshape(1), kv_len_B.astype(jnp.int32),
                table_BY.astype(jnp.int32), y_BJH]
    in_specs = [whole((1,)), whole((B,)), row((Y,)), row((J, H))]
    extra = ([bias_JH] if has_bias else []) + ([q_norm_H, k_norm_H] if has_norm else [])
    operands += extra
    in_specs += [whole(a.shape) for a in extra]
    operands += [cos_BH2.astype(jnp.float32), sin_BH2.astype(jnp.float32),
                 write_page_B.astype(jnp.int32), write_offset_B.astype(jnp.int32),
                 k_pages, v_pages]
    in_specs += [row((H // 2,)), row((H // 2,)), whole((B,)), whole((B,)),
                 whole(k_pages.shape), whole(v_pages.shape)]
    out_shape, out_specs = _attention_outputs(B, N, H, k_splits, y_BJH.dtype)
    n_out = len(out_shape)
    out_shape += [jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                  jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)]
    out_specs += [whole(k_pages.shape), whole(v_pages.shape)]
    outs = pl.pallas_call(
        kernel, grid=(B, K // Kp, k_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        input_output_aliases={len(operands) - 2: n_out, len(operands) - 1: n_out + 1},
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        name=f"lrl_fused_decode_{pages_per_block}x{page_size}",
    )(*operands)
    k_pages, v_pages = outs[n_out], outs[n_out + 1]
    if not split:
        return outs[0], k_pages, v_pages
    return _combine_splits(*outs[:3], y_BJH.dtype), k_pages, v_pages
