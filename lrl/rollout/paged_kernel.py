"""Our Pallas (Triton) decode-attention kernel over the paged KV pool, for grouped queries.

A program streams one row's pages block by block with an online softmax, for the query heads
of J kv heads (`kv_per_program`) over one kv split. What it does that jax's Pallas GPU paged
attention (`jax.experimental.pallas.ops.gpu.paged_attention`, deprecated in jax 0.11) does
not:
- q enters as the model makes it, [B, N, H], unpadded and unscaled. A program reads its J·G
  rows into a 16-row tile by index, and rows past J·G repeat the last one. jax's kernel wants
  q padded to 16 heads per kv head, and the pad plus the scale was an XLA fusion per layer
  (0.09 ms of a 4.25 ms decode step at 256 slots on the H200). The repeated rows compute the
  same output as the row they repeat and are stored to the same address.
- with J > 1 the query heads of several kv heads share the tile (Qwen2.5-1.5B: 2 × 6 rows of
  16, where jax's kernel pads each 6 to 16) and one softmax pass.
- with one kv split, the program writes the normalised output in the model's dtype. jax's
  kernel returns per-split partial sums, which XLA rescales, sums and divides: several more
  small ops per layer.
- the layer's base page index enters as an operand. There is no XLA add of it into the
  [B, M] page table at every layer.

B rows · N query heads · K kv heads · G query heads per kv head · H head dim ·
M pages per row · S keys of a block · X kv splits · R rows of the q tile.
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
    G = n_heads // n_kv_heads
    J = max(1, 16 // G)
    while n_kv_heads % J:
        J -= 1
    return J


def _kernel(base_ref, len_ref, table_ref, q_ref, *refs, G: int, J: int,
            pages_per_block: int, pages_per_split: int, scale: float, split: bool):
    """Program (b, g, x): row b, kv heads g*J .. g*J+J-1, split x. Its J*G query rows share one
    tile; row r's scores sum J dots, each with the q rows of one kv head kept and the others
    zeroed, so every row sees only its own head's keys; its output row is taken from its own
    head's p @ V."""
    k_refs, v_refs, out_refs = refs[:J], refs[J:2 * J], refs[2 * J:]
    b, g, x = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R = _tile_rows(J * G)
    local_R = jnp.minimum(jnp.arange(R), J * G - 1)   # rows past J*G repeat the last real one
    rows_R = g * J * G + local_R
    head_R1 = (local_R // G)[:, None]                  # which of the program's kv heads
    q_RH = (q_ref[rows_R, :].astype(jnp.float32) * scale).astype(k_refs[0].dtype)
    q_by_head = [jnp.where(head_R1 == j, q_RH, jnp.zeros_like(q_RH)) if J > 1 else q_RH
                 for j in range(J)]
    page_size, H = k_refs[0].shape[-2], k_refs[0].shape[-1]
    block = pages_per_block * page_size
    length, base = len_ref[b], base_ref[0]
    first_page = x * pages_per_split
    last_page = jnp.minimum(pl.cdiv(length, page_size), first_page + pages_per_split)
    n_blocks = pl.cdiv(jnp.maximum(last_page - first_page, 0), pages_per_block)

    def body(i, carry):
        o_RH, m_R, l_R = carry
        page0 = first_page + i * pages_per_block
        pages = table_ref[pl.ds(page0, pages_per_block)] + base
        s_RS = sum(plgpu.dot(q_by_head[j], k_refs[j][pages].reshape(block, H), trans_b=True)
                   for j in range(J))
        visible_S = page0 * page_size + jnp.arange(block) < length
        s_RS = jnp.where(visible_S[None, :], s_RS, _MASK)
        m_new = jnp.maximum(m_R, s_RS.max(axis=-1))
        correction = jnp.exp(m_R - m_new)
        p_RS = jnp.exp(s_RS - m_new[:, None])
        p_lo = p_RS.astype(v_refs[0].dtype)
        pv_RH = plgpu.dot(p_lo, v_refs[0][pages].reshape(block, H))
        for j in range(1, J):
            pv_RH = jnp.where(head_R1 == j, plgpu.dot(p_lo, v_refs[j][pages].reshape(block, H)),
                              pv_RH)
        return o_RH * correction[:, None] + pv_RH, m_new, l_R * correction + p_RS.sum(axis=-1)

    init = (jnp.zeros((R, H), jnp.float32), jnp.full((R,), _MASK, jnp.float32),
            jnp.zeros((R,), jnp.float32))
    o_RH, m_R, l_R = jax.lax.fori_loop(0, n_blocks, body, init)
    if split:
        o_ref, m_ref, l_ref = out_refs
        o_ref[rows_R, :] = o_RH
        m_ref[rows_R] = m_R
        l_ref[rows_R] = l_R
    else:   # a row with no key (an idle slot) gets zeros
        (o_ref,) = out_refs
        o_ref[rows_R, :] = (o_RH / jnp.where(l_R > 0, l_R, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("pages_per_block", "k_splits", "warps", "stages",
                                             "kv_per_program", "interpret"))
def paged_decode_attention(q_BNH, k_pages, v_pages, table_BM, kv_len_B, layer_base, *,
                           pages_per_block: int = 2, k_splits: int = 1, warps: int = 4,
                           stages: int = 1, kv_per_program: int = 1, interpret: bool = False):
    """One query per row over its first `kv_len_B` cached tokens -> [B, N, H] in q's dtype.

    k_pages, v_pages: [K, L * P, page_size, H]; table_BM holds each row's pages of layer 0,
    `layer_base` (int or int32 scalar) is added to them. `k_splits` splits each row's pages
    over that many programs (a few long rows still fill the GPU); their partial results are
    combined here. `kv_per_program` kv heads share one program (0: `kv_heads_per_program`), so
    their query heads share one 16-row tile and one softmax pass instead of each padding its
    own."""
    B, N, H = q_BNH.shape
    K, LP, page_size, Hk = k_pages.shape
    M = table_BM.shape[1]
    if Hk != H or N % K:
        raise ValueError(f"q [B, N={N}, H={H}] does not fit pages [K={K}, ..., H={Hk}]")
    for name, v in (("pages_per_block", pages_per_block), ("head dim", H)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if pages_per_block * page_size < 16 and not interpret:   # the interpreter has no such floor
        raise ValueError(f"a block of {pages_per_block} pages x {page_size} tokens is under "
                         "the 16 tokens Triton's dot needs")
    if M % (k_splits * pages_per_block):
        raise ValueError(f"pages per row {M} must be a multiple of k_splits * pages_per_block "
                         f"= {k_splits} * {pages_per_block}")
    G = N // K
    J = kv_heads_per_program(N, K, kv_per_program)
    if K % J:
        raise ValueError(f"kv_per_program {J} does not divide the {K} kv heads")
    split = k_splits > 1
    kernel = functools.partial(_kernel, G=G, J=J, pages_per_block=pages_per_block,
                               pages_per_split=M // k_splits, scale=1.0 / H ** 0.5, split=split)
    head = lambda j: pl.BlockSpec((None, LP, page_size, H),  # noqa: E731
                                  lambda b, g, x: (g * J + j, 0, 0, 0))
    whole = lambda shape: pl.BlockSpec(shape, lambda b, g, x: (0,) * len(shape))  # noqa: E731
    in_specs = [whole((1,)), whole((B,)),
                pl.BlockSpec((None, M), lambda b, g, x: (b, 0)),
                pl.BlockSpec((None, N, H), lambda b, g, x: (b, 0, 0)),
                *(head(j) for j in range(J)), *(head(j) for j in range(J))]
    if split:
        out_shape = [jax.ShapeDtypeStruct((k_splits, B, N, H), jnp.float32),
                     jax.ShapeDtypeStruct((k_splits, B, N), jnp.float32),
                     jax.ShapeDtypeStruct((k_splits, B, N), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, N, H), lambda b, g, x: (x, b, 0, 0)),
                     pl.BlockSpec((None, None, N), lambda b, g, x: (x, b, 0)),
                     pl.BlockSpec((None, None, N), lambda b, g, x: (x, b, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, N, H), q_BNH.dtype)]
        out_specs = [pl.BlockSpec((None, N, H), lambda b, g, x: (b, 0, 0))]
    outs = pl.pallas_call(
        kernel, grid=(B, K // J, k_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        name=f"lrl_paged_decode_{pages_per_block}x{page_size}",
    )(jnp.asarray(layer_base, jnp.int32).reshape(1), kv_len_B.astype(jnp.int32),
      table_BM.astype(jnp.int32), q_BNH, *(k_pages,) * J, *(v_pages,) * J)
    if not split:
        return outs[0]
    o_XBNH, m_XBN, l_XBN = outs
    w_XBN = jnp.exp(m_XBN - m_XBN.max(axis=0))
    l_BN = (l_XBN * w_XBN).sum(axis=0)
    o_BNH = (o_XBNH * w_XBN[..., None]).sum(axis=0) / jnp.where(l_BN > 0, l_BN, 1.0)[..., None]
    return o_BNH.astype(q_BNH.dtype)
