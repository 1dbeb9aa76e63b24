"""Token log-probabilities and entropies from final hidden states, in chunks of positions, so
the [T, V] logits never exist whole, neither in the forward pass nor in the backward pass.

At 128K tokens × 152K vocabulary the fp32 logits would take 78 GB. Here a `lax.scan` visits
C positions of every row at a time; a `custom_vjp` keeps only the per-token log-sum-exp and
entropy as residuals and recomputes each chunk's logits in the backward pass, where it forms
d(logits) for the chunk and folds it straight into d(hidden) and d(unembedding).

Chunk k holds the positions {c·n + k : c < C} of every row (n = T / C chunks): strided rather
than contiguous, so when T is sharded over the `seq` mesh axis every device works on its own
share of every chunk instead of the scan walking from one device's block to the next.

Dimension letters: B batch rows · T positions · D model width · V vocabulary · C chunk
(positions per row per step of the scan).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _chunk_logits(h_BCD, w_DV):
    # Compute-dtype matmul with fp32 accumulation and fp32 logits.
    return jnp.einsum("bcd,dv->bcv", h_BCD, w_DV, preferred_element_type=jnp.float32)


def _chunk_stats(h_BCD, w_DV, tgt_BC, compute_entropy):
    """One chunk's logits and what is read from them: (z, lse, target one-hot, logp, p, ent);
    p (the softmax) only when the entropy needs it, else None."""
    z_BCV = _chunk_logits(h_BCD, w_DV)
    lse_BC = jax.nn.logsumexp(z_BCV, axis=-1)
    # A compare against the vocabulary instead of a gather: it also works when V is sharded.
    onehot_BCV = jnp.arange(w_DV.shape[1], dtype=tgt_BC.dtype) == tgt_BC[..., None]
    logp_BC = jnp.sum(jnp.where(onehot_BCV, z_BCV, 0.0), axis=-1) - lse_BC
    if not compute_entropy:
        return z_BCV, lse_BC, onehot_BCV, logp_BC, None, jnp.zeros_like(lse_BC)
    p_BCV = jnp.exp(z_BCV - lse_BC[..., None])
    ent_BC = lse_BC - jnp.sum(p_BCV * z_BCV, axis=-1)
    return z_BCV, lse_BC, onehot_BCV, logp_BC, p_BCV, ent_BC


def _chunk_grads(h_BCD, w_DV, z_BCV, lse_BC, ent_BC, onehot_BCV, p_BCV, glogp_BC, gent_BC,
                 compute_entropy):
    """d(hidden) [B, C, D] and this chunk's share of d(w) [D, V], both float32, from the
    cotangents of the chunk's log-probs and entropies."""
    if p_BCV is None:
        p_BCV = jnp.exp(z_BCV - lse_BC[..., None])
    # d logp_target / dz = onehot(target) - p.
    dz_BCV = glogp_BC[..., None] * (onehot_BCV.astype(jnp.float32) - p_BCV)
    if compute_entropy:
        # dH/dz_j = -p_j (log p_j + H), log p_j = z_j - lse.
        dz_BCV -= gent_BC[..., None] * p_BCV * (z_BCV - lse_BC[..., None] + ent_BC[..., None])
    dz_BCV = dz_BCV.astype(h_BCD.dtype)
    dh_BCD = jnp.einsum("bcv,dv->bcd", dz_BCV, w_DV, preferred_element_type=jnp.float32)
    dw_DV = jnp.einsum("bcd,bcv->dv", h_BCD, dz_BCV, preferred_element_type=jnp.float32)
    return dh_BCD, dw_DV


def _layout(x_BT, n, chunk):
    """[B, T, ...] -> [B, C, n, ...] after padding T to n·C (position c·n + k -> [c, k])."""
    b, t = x_BT.shape[:2]
    pad = n * chunk - t
    if pad:
        x_BT = jnp.pad(x_BT, [(0, 0), (0, pad)] + [(0, 0)] * (x_BT.ndim - 2))
    return x_BT.reshape(b, chunk, n, *x_BT.shape[2:])


def _unlayout(x_nBC, t):
    """Scan output [n, B, C, ...] -> [B, T, ...]."""
    n, b, c = x_nBC.shape[:3]
    x_BCn = jnp.moveaxis(x_nBC, 0, 2)
    return x_BCn.reshape(b, c * n, *x_nBC.shape[3:])[:, :t]


def _forward(h_BTD, w_DV, targets_BT, chunk, compute_entropy):
    t = h_BTD.shape[1]
    n = -(-t // chunk)
    h_BCnD = _layout(h_BTD, n, chunk)
    tgt_BCn = _layout(targets_BT, n, chunk)

    def step(_, k):
        _, lse_BC, _, logp_BC, _, ent_BC = _chunk_stats(
            jax.lax.dynamic_index_in_dim(h_BCnD, k, 2, keepdims=False), w_DV,
            jax.lax.dynamic_index_in_dim(tgt_BCn, k, 2, keepdims=False), compute_entropy)
        return None, (logp_BC, lse_BC, ent_BC)

    _, (logp_nBC, lse_nBC, ent_nBC) = jax.lax.scan(step, None, jnp.arange(n))
    return logp_nBC, lse_nBC, ent_nBC


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(h_BTD, w_DV, targets_BT, chunk, compute_entropy):
    logp_nBC, _, ent_nBC = _forward(h_BTD, w_DV, targets_BT, chunk, compute_entropy)
    t = h_BTD.shape[1]
    return _unlayout(logp_nBC, t), _unlayout(ent_nBC, t)


def _chunked_fwd(h_BTD, w_DV, targets_BT, chunk, compute_entropy):
    logp_nBC, lse_nBC, ent_nBC = _forward(h_BTD, w_DV, targets_BT, chunk, compute_entropy)
    t = h_BTD.shape[1]
    out = (_unlayout(logp_nBC, t), _unlayout(ent_nBC, t))
    return out, (h_BTD, w_DV, targets_BT, lse_nBC, ent_nBC)


def _chunked_bwd(chunk, compute_entropy, res, g):
    h_BTD, w_DV, targets_BT, lse_nBC, ent_nBC = res
    g_logp_BT, g_ent_BT = g
    b, t, d = h_BTD.shape
    n = lse_nBC.shape[0]
    h_BCnD = _layout(h_BTD, n, chunk)
    tgt_BCn = _layout(targets_BT, n, chunk)
    glogp_BCn = _layout(g_logp_BT.astype(jnp.float32), n, chunk)
    gent_BCn = _layout(g_ent_BT.astype(jnp.float32), n, chunk)
    vocab_V = jnp.arange(w_DV.shape[1], dtype=targets_BT.dtype)
    take = lambda x, k: jax.lax.dynamic_index_in_dim(x, k, 2, keepdims=False)  # noqa: E731

    def step(dw_DV, k):
        h_BCD = take(h_BCnD, k)
        onehot_BCV = vocab_V == take(tgt_BCn, k)[..., None]
        dh_BCD, dw_k = _chunk_grads(h_BCD, w_DV, _chunk_logits(h_BCD, w_DV), lse_nBC[k],
                                    ent_nBC[k], onehot_BCV, None, take(glogp_BCn, k),
                                    take(gent_BCn, k), compute_entropy)
        return dw_DV + dw_k, dh_BCD.astype(h_BTD.dtype)

    dw_DV, dh_nBCD = jax.lax.scan(step, jnp.zeros(w_DV.shape, jnp.float32), jnp.arange(n))
    return _unlayout(dh_nBCD, t), dw_DV.astype(w_DV.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def token_logprobs_and_entropy(hidden_BTD, w_DV, targets_BT, *, chunk: int = 1024,
                               compute_entropy: bool = True):
    """log softmax(hidden · w)[target] and the entropy of that softmax, per token, in fp32.

    hidden_BTD: final (normed) hidden states in the compute dtype; w_DV: unembedding (cast to
    the hidden dtype for the matmul, logits accumulate in fp32); targets_BT: int token ids.
    `chunk` positions of every row are processed at a time, so the largest temporary is about
    B·chunk·V fp32 values (times a few). Differentiable in hidden and w (both outputs);
    without `compute_entropy` the entropy returned is zeros.
    """
    if hidden_BTD.ndim != 3 or w_DV.ndim != 2 or hidden_BTD.shape[2] != w_DV.shape[0]:
        raise ValueError(f"logprobs: need hidden [B, T, D] and w [D, V] with matching D, got "
                         f"{hidden_BTD.shape} and {w_DV.shape}")
    if targets_BT.shape != hidden_BTD.shape[:2]:
        raise ValueError(f"logprobs: targets_BT has shape {targets_BT.shape}, expected "
                         f"{hidden_BTD.shape[:2]}")
    if not jnp.issubdtype(targets_BT.dtype, jnp.integer):
        raise ValueError(f"logprobs: targets_BT must be integer ids, got {targets_BT.dtype}")
    if chunk <= 0:
        raise ValueError(f"logprobs: chunk must be positive, got {chunk}")
    t = hidden_BTD.shape[1]
    # Even chunks: padding stays below the number of chunks (T=1025, chunk=1024 -> 2 × 513).
    n = -(-t // chunk)
    chunk = -(-t // n)
    return _chunked(hidden_BTD, w_DV.astype(hidden_BTD.dtype), targets_BT, chunk,
                    compute_entropy)
