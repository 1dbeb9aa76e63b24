"""The loss of a token-separable objective with its gradient formed in the same pass over the
logits chunks: no logits are recomputed in the backward pass.

`lrl.rl.logprobs` computes log-probs and entropies in chunks and, in the backward pass,
recomputes every chunk's logits to form d(logits). When the loss is a sum of per-token
terms, each a function of that token's log-prob and entropy only (token-level ratios: PPO
clip, clip-higher, dual clip, KL to a reference, entropy bonus, truncated IS), the gradient
of a token's term with respect to its log-prob is known as soon as the log-prob is. This pass
then does, per chunk: logits, log-prob and entropy, the per-token loss and its gradient,
d(logits), and their products with the unembedding and the hidden states. The backward pass
only scales the saved d(hidden) and d(unembedding) by the loss's cotangent. That is three
[C, D] x [D, V]-sized matmuls per chunk instead of four (the same trade as Liger's fused
linear cross-entropy). Sequence-level ratios (GSPO) couple a sequence's tokens and go the
unfused way.

Dimension letters: B batch rows · T positions · D model width · V vocabulary · C chunk
(positions per row per step of the scan).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lrl.rl.logprobs import _chunk_grads, _chunk_stats, _layout, _unlayout


def _pass(h_BTD, w_DV, targets_BT, aux, chunk, compute_entropy, token_loss):
    t = h_BTD.shape[1]
    n = -(-t // chunk)
    h_BCnD = _layout(h_BTD, n, chunk)
    tgt_BCn = _layout(targets_BT, n, chunk)
    # padded positions get zero weight through the padded aux arrays (all zeros)
    aux_BCn = {k: _layout(x, n, chunk) for k, x in aux.items()}
    take = lambda x, k: jax.lax.dynamic_index_in_dim(x, k, 2, keepdims=False)  # noqa: E731

    def step(carry, k):
        loss, dw_DV = carry
        h_BCD = take(h_BCnD, k)
        z_BCV, lse_BC, onehot_BCV, logp_BC, p_BCV, ent_BC = _chunk_stats(
            h_BCD, w_DV, take(tgt_BCn, k), compute_entropy)
        aux_BC = {key: take(x, k) for key, x in aux_BCn.items()}
        chunk_loss = lambda lp, en: jnp.sum(token_loss(lp, en, aux_BC))  # noqa: E731
        part, (glogp_BC, gent_BC) = jax.value_and_grad(chunk_loss, argnums=(0, 1))(logp_BC,
                                                                                    ent_BC)
        dh_BCD, dw_k = _chunk_grads(h_BCD, w_DV, z_BCV, lse_BC, ent_BC, onehot_BCV, p_BCV,
                                    glogp_BC, gent_BC, compute_entropy)
        return (loss + part, dw_DV + dw_k), (logp_BC, ent_BC, dh_BCD.astype(h_BTD.dtype))

    init = (jnp.zeros((), jnp.float32), jnp.zeros(w_DV.shape, jnp.float32))
    (loss, dw_DV), (logp_nBC, ent_nBC, dh_nBCD) = jax.lax.scan(step, init, jnp.arange(n))
    return (loss, _unlayout(logp_nBC, t), _unlayout(ent_nBC, t),
            _unlayout(dh_nBCD, t), dw_DV.astype(w_DV.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(h_BTD, w_DV, targets_BT, aux, chunk, compute_entropy, token_loss):
    loss, logp_BT, ent_BT, _, _ = _pass(h_BTD, w_DV, targets_BT, aux, chunk, compute_entropy,
                                        token_loss)
    return loss, logp_BT, ent_BT


def _fused_fwd(h_BTD, w_DV, targets_BT, aux, chunk, compute_entropy, token_loss):
    loss, logp_BT, ent_BT, dh_BTD, dw_DV = _pass(h_BTD, w_DV, targets_BT, aux, chunk,
                                                 compute_entropy, token_loss)
    return (loss, logp_BT, ent_BT), (dh_BTD, dw_DV, aux)


def _fused_bwd(chunk, compute_entropy, token_loss, res, g):
    dh_BTD, dw_DV, aux = res
    g_loss = g[0]  # logp and entropy leave `fused_token_loss` without gradient
    return ((g_loss * dh_BTD).astype(dh_BTD.dtype), (g_loss * dw_DV).astype(dw_DV.dtype),
            None, jax.tree.map(jnp.zeros_like, aux))


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_token_loss(hidden_BTD, w_DV, targets_BT, token_loss, aux, *, chunk: int = 1024,
                     compute_entropy: bool = True):
    """-> (sum over tokens of token_loss(logp, entropy, aux), logp_BT, entropy_BT).

    `token_loss(logp_BC, ent_BC, aux_BC)` must be elementwise over tokens (a token's term
    reads only its own log-prob, entropy and aux values) and hashable (a function or a
    partial of hashable arguments): it is traced once per chunk. `aux` is a dict of [B, T]
    per-token arrays (advantages, weights, old log-probs...), without gradient. The loss is
    differentiable in hidden and w; logp and entropy are returned without gradient, for
    metrics. Without `compute_entropy` the entropy passed to token_loss is zeros.
    """
    if hidden_BTD.ndim != 3 or w_DV.ndim != 2 or hidden_BTD.shape[2] != w_DV.shape[0]:
        raise ValueError(f"fused_token_loss: need hidden [B, T, D] and w [D, V] with matching "
                         f"D, got {hidden_BTD.shape} and {w_DV.shape}")
    for name, x in (("targets_BT", targets_BT), *((f"aux[{k!r}]", v) for k, v in aux.items())):
        if x.shape != hidden_BTD.shape[:2]:
            raise ValueError(f"fused_token_loss: {name} has shape {x.shape}, expected "
                             f"{hidden_BTD.shape[:2]}")
    if chunk <= 0:
        raise ValueError(f"fused_token_loss: chunk must be positive, got {chunk}")
    t = hidden_BTD.shape[1]
    n = -(-t // chunk)
    aux = {k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}
    loss, logp_BT, ent_BT = _fused(hidden_BTD, w_DV.astype(hidden_BTD.dtype),
                                   targets_BT.astype(jnp.int32), aux, -(-t // n),
                                   compute_entropy, token_loss)
    return loss, jax.lax.stop_gradient(logp_BT), jax.lax.stop_gradient(ent_BT)
