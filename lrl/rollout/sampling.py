"""Token sampling for the rollout: greedy, temperature, top-k and top-p, with per-sample keys
and the log-probability of every sampled token.

The log-prob is taken under the distribution the token was drawn from: logits divided by the
temperature, restricted to the top-k and then the top-p set and renormalised. Greedy decoding
(temperature 0) reports the log-prob under the model's plain softmax. Keys depend only on the
run's seed, the sample's id and the step, so a sample does not change with the slot it runs in
or with what else is in the batch.

B batch rows (the engine's slots) · V vocabulary (also the tokens of one block) · U vocabulary
blocks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lrl.rollout import sample_kernel


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 means greedy
    top_k: int = 0             # 0 means no top-k cut
    top_p: float = 1.0         # 1 means no nucleus cut

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_keys(rng, sample_ids_B, steps_B):
    """One key per row: the run key folded with the sample's id, then with its step."""
    return jax.vmap(lambda u, s: jax.random.fold_in(jax.random.fold_in(rng, u), s))(
        sample_ids_B, steps_B)


def filter_logits(logits_BV, sp: SamplingParams):
    """Temperature-scaled logits with everything outside top-k / top-p set to -inf."""
    x = logits_BV.astype(jnp.float32) / jnp.float32(sp.temperature)
    V = x.shape[-1]
    if 0 < sp.top_k < V:
        kth_B1 = jax.lax.top_k(x, sp.top_k)[0][:, -1:]
        x = jnp.where(x < kth_B1, -jnp.inf, x)
    if sp.top_p < 1.0:
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p: a
        # token stays when the mass strictly above it is below top_p (the first always does).
        sorted_BV = jnp.flip(jnp.sort(x, axis=-1), axis=-1)
        probs = jax.nn.softmax(sorted_BV, axis=-1)
        mass_above = jnp.cumsum(probs, axis=-1) - probs
        n_keep_B1 = jnp.maximum(jnp.sum(mass_above < sp.top_p, axis=-1, keepdims=True), 1)
        cutoff_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)
        x = jnp.where(x < cutoff_B1, -jnp.inf, x)
    return x


def _block_size(V: int) -> int:
    """Tokens per block of the two-level inverse CDF: the largest divisor of V up to 1024
    (151,936 = 1,187 blocks of 128), or 1024 with padding when V has no divisor from 64 up."""
    best = max(d for d in range(1, min(V, 1024) + 1) if V % d == 0)
    return best if best >= 64 or best == V else 1024


def _kernel_block(V: int) -> int:
    """Tokens per block for `sample_kernel.block_stats`: the largest power of two up to 1024
    that divides V (Qwen: 128, Llama 3: 256), or 0 below 64 (the XLA path then)."""
    block = min(V & -V, 1024)
    return block if block >= 64 else 0


def draw(x_BV, keys_B, block: int = 0, stats=None):
    """-> (tokens int32 [B], log-probs float32 [B]): one draw per row from softmax(x), by
    inverse CDF over two levels: one uniform per row picks a block of tokens by the blocks'
    cumulative mass, then a token inside it. It reads the [B, V] logits twice (max, then
    per-block sums of exp), or once for the chosen blocks given their `stats` (see
    `invert_cdf`), where jax.random.categorical draws V Gumbel variables a row, which cost
    the decode step more (docs/benchmark-history.md, "Measurements once quoted in the code").
    Tokens at -inf (filtered out) have no mass and are never drawn."""
    return invert_cdf(x_BV, jax.vmap(jax.random.uniform)(keys_B), block, stats)


def invert_cdf(x_BV, u_B, block: int = 0, stats=None):
    """`draw` for given uniforms u in [0, 1): the token where u * (total mass) falls.
    `stats`: the blocks' (max, sum of exp against it) of x, [B, U] each, when a kernel has
    already taken them (`sample_kernel.block_stats`); x is then read only for the chosen
    block of each row."""
    B, V = x_BV.shape
    block = block or _block_size(V)
    nb = -(-V // block)
    x = x_BV if nb * block == V else jnp.pad(x_BV, ((0, 0), (0, nb * block - V)),
                                             constant_values=-jnp.inf)
    if stats is None:
        m_B1 = x.max(axis=-1, keepdims=True)
        mass_BU = jnp.exp(x - m_B1).reshape(B, nb, block).sum(axis=-1)
    else:   # each block's max and sum of exp against it, put on the row's max here
        m_BU, s_BU = stats
        m_B1 = m_BU.max(axis=-1, keepdims=True)
        mass_BU = s_BU * jnp.exp(m_BU - m_B1)
    cum_BU = jnp.cumsum(mass_BU, axis=-1)
    u_B1 = u_B[:, None] * cum_BU[:, -1:]
    # The counts below land on a token with mass except at the edges, where rounding can put
    # u at the very top, or a block's first cumulative sum a rounding above u: clip there to
    # the first and last blocks and tokens that have mass.
    last_block_B = nb - 1 - jnp.argmax(jnp.flip(mass_BU > 0, axis=-1), axis=-1)
    j_B = jnp.minimum(jnp.sum(cum_BU <= u_B1, axis=-1), last_block_B)
    before_B1 = jnp.take_along_axis(cum_BU - mass_BU, j_B[:, None], axis=-1)
    # xb: the logits of each row's chosen block, [B, block] (V here: one block of it)
    xb_BV = jnp.take_along_axis(x.reshape(B, nb, block), j_B[:, None, None], axis=1)[:, 0]
    e_BV = jnp.exp(xb_BV - m_B1)
    first_B = jnp.argmax(e_BV > 0, axis=-1)
    last_B = block - 1 - jnp.argmax(jnp.flip(e_BV > 0, axis=-1), axis=-1)
    i_B = jnp.clip(jnp.sum(before_B1 + jnp.cumsum(e_BV, axis=-1) <= u_B1, axis=-1),
                   first_B, last_B)
    tokens_B = (j_B * block + i_B).astype(jnp.int32)
    lse_B = m_B1[:, 0] + jnp.log(cum_BU[:, -1])
    logp_B = jnp.take_along_axis(xb_BV, i_B[:, None], axis=-1)[:, 0] - lse_B
    return tokens_B, logp_B


IMPLS = ("xla", "pallas", "pallas_interpret")


def sample(logits_BV, keys_B, sp: SamplingParams, impl: str = "xla"):
    """-> (tokens int32 [B], log-probs float32 [B]) of one draw per row. impl "pallas" takes
    the blocks' masses in one read of the logits by our kernel (GPU; "pallas_interpret" runs
    it in the Pallas interpreter), "xla" in two XLA reductions. Both invert the same CDF with
    the same uniforms, so they draw the same tokens but where rounding moves a boundary."""
    if impl not in IMPLS:
        raise ValueError(f"sampling impl {impl!r}; choose one of {IMPLS}")
    logits_BV = logits_BV.astype(jnp.float32)
    if not sp.greedy:
        x_BV = filter_logits(logits_BV, sp)
        block = _kernel_block(x_BV.shape[-1])
        if impl == "xla" or not block:
            return draw(x_BV, keys_B)
        # Unfiltered, the kernel reads the logits and divides by the temperature itself, so
        # that the scaled copy is never written; the filters write theirs anyway.
        filtered = 0 < sp.top_k < x_BV.shape[-1] or sp.top_p < 1.0
        stats = sample_kernel.block_stats(
            x_BV if filtered else logits_BV, block=block,
            temperature=1.0 if filtered else sp.temperature,
            interpret=impl == "pallas_interpret")
        return draw(x_BV, keys_B, block, stats)
    tokens_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    return tokens_B, jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
