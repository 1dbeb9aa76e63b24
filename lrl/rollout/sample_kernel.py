"""Our Pallas (Triton) kernel for the sampler's one pass over the logits: per block of tokens,
its max and its sum of exp relative to that max.

The two-level inverse CDF of `sampling.invert_cdf` needs the mass of every block of a row. In
XLA that is two reductions over the [B, V] fp32 logits, the row's max and then the blocks'
sums of exp against it, each a full read of 155 MB at 256 rows of 151,936 tokens
(docs/benchmark-history.md, "Eighth session", "Where the sampler's time went"). Against each block's own
max, one read suffices; the blocks are then put on the row's scale from the small [B, U]
result.

B batch rows · U vocabulary blocks of a row · V vocabulary (in the kernel, the tokens of one
block).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(x_ref, m_ref, s_ref, *, n_blocks: int, per_program: int, temperature: float):
    """Program (b, j): blocks j*per_program .. of row b. The last program's range is moved back
    to end at the row's last block, so no load leaves the row; the blocks it shares with the
    program before it get the same values twice."""
    start = jnp.minimum(pl.program_id(1) * per_program, n_blocks - per_program)
    x_UV = x_ref[pl.ds(start, per_program), :].astype(jnp.float32)
    if temperature != 1.0:
        x_UV = x_UV / temperature
    m_U = x_UV.max(axis=1)
    ref_U = jnp.where(m_U == -jnp.inf, 0.0, m_U)    # a block without mass sums to 0, not NaN
    m_ref[pl.ds(start, per_program)] = m_U
    s_ref[pl.ds(start, per_program)] = jnp.exp(x_UV - ref_U[:, None]).sum(axis=1)


@functools.partial(jax.jit, static_argnames=("block", "temperature", "per_program", "warps",
                                             "interpret"))
def block_stats(x_BV, *, block: int, temperature: float = 1.0, per_program: int = 64,
                warps: int = 8, interpret: bool = False):
    """-> (max [B, U], sum of exp(x / temperature - max) [B, U]), both fp32, over the blocks of
    `block` tokens of x / temperature. A block whose tokens are all -inf has max -inf and sum
    0. V must be a multiple of `block`, a power of two. A program takes `per_program` blocks
    of a row: 64 blocks and 8 warps were the fastest setting of the kernel alone, and whole
    decode steps ran as fast with them as with 32 and 4 (docs/benchmark-history.md, "Eighth session",
    "The kernel")."""
    B, V = x_BV.shape
    if block & (block - 1) or V % block:
        raise ValueError(f"block_stats: block {block} must be a power of two dividing V={V}")
    if per_program < 1 or per_program & (per_program - 1):
        raise ValueError(f"block_stats: per_program must be a power of two, got {per_program}")
    U = V // block
    per_program = min(per_program, 1 << (U.bit_length() - 1))   # a power of two, at most U
    kernel = functools.partial(_kernel, n_blocks=U, per_program=per_program,
                               temperature=float(temperature))
    row = pl.BlockSpec((None, U), lambda b, j: (b, 0))
    return pl.pallas_call(
        kernel, grid=(B, pl.cdiv(U, per_program)),
        in_specs=[pl.BlockSpec((None, U, block), lambda b, j: (b, 0, 0))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((B, U), jnp.float32)] * 2,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        name=f"lrl_sample_block_stats_{block}",
    )(x_BV.reshape(B, U, block))
