"""The decoder-only language model (Llama 3.x, Qwen2/2.5, Qwen3) in Flax linen.

Layers are one `Block` scanned over a stacked parameter axis (compile time does not grow with
depth) and rematerialised with the policy `cfg.remat` names. A `Block` exposes its two halves,
`qkv` and `finish`, so the rollout engine can run the same weights with its own paged
attention in between.

B batch · T positions · D model width · F MLP width · V vocabulary · N query heads ·
K kv heads · H head dim · L layers.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from lrl import mesh as mesh_lib
from lrl.models import grad_sink
from lrl.models.attention import attend
from lrl.models.config import ModelConfig
from lrl.models.layers import RMSNorm, apply_rope, remat_policy, rope_angles

_init = nn.initializers.normal(stddev=0.02)


def constrain(x, mesh, seq: bool = True):
    """Rows over (data, fsdp), positions over seq: the activation layout between layers."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, mesh_lib.batch_spec(mesh, x.ndim, seq)))


class Block(nn.Module):
    cfg: ModelConfig
    mesh: Any = None

    def setup(self):
        c = self.cfg
        dense = dict(dtype=c.dtype, param_dtype=c.param_dtype, kernel_init=_init)
        norm = dict(eps=c.rms_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype)
        self.input_norm = RMSNorm(**norm)
        self.q_proj = nn.DenseGeneral((c.n_heads, c.head_dim), use_bias=c.qkv_bias, **dense)
        self.k_proj = nn.DenseGeneral((c.n_kv_heads, c.head_dim), use_bias=c.qkv_bias, **dense)
        self.v_proj = nn.DenseGeneral((c.n_kv_heads, c.head_dim), use_bias=c.qkv_bias, **dense)
        if c.qk_norm:
            self.q_norm = RMSNorm(**norm)
            self.k_norm = RMSNorm(**norm)
        self.o_proj = nn.DenseGeneral(c.d_model, axis=(-2, -1), use_bias=c.o_bias, **dense)
        self.post_attn_norm = RMSNorm(**norm)
        self.gate_proj = nn.Dense(c.mlp_dim, use_bias=c.mlp_bias, **dense)
        self.up_proj = nn.Dense(c.mlp_dim, use_bias=c.mlp_bias, **dense)
        self.down_proj = nn.Dense(c.d_model, use_bias=c.mlp_bias, **dense)

    def qkv(self, x_BTD, positions_BT):
        """Normalised input -> rotated q [B,T,N,H], k and v [B,T,K,H]."""
        h = self.input_norm(x_BTD)
        return self.rotate(self.q_proj(h), self.k_proj(h), self.v_proj(h), positions_BT)

    def rotate(self, q_BTNH, k_BTKH, v_BTKH, positions_BT):
        """Projected q, k, v -> normalised (Qwen3) and rotated q and k, and v."""
        if self.cfg.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        cos, sin = rope_angles(self.cfg, positions_BT)
        return apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin), v_BTKH

    def finish(self, x_BTD, attn_BTNH):
        """Output projection, residual, then the SwiGLU MLP and its residual."""
        x = x_BTD + self.o_proj(attn_BTNH)
        h = self.post_attn_norm(x)
        return x + self.down_proj(nn.silu(self.gate_proj(h)) * self.up_proj(h))

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, prefix_ids_BT=None):
        q, k, v = self.qkv(x_BTD, positions_BT)
        attn = attend(self.cfg, self.mesh, q, k, v, segment_ids_BT, prefix_ids_BT)
        return constrain(self.finish(x_BTD, attn), self.mesh), None


class Decoder(nn.Module):
    cfg: ModelConfig
    mesh: Any = None

    def setup(self):
        c = self.cfg
        self.embed = nn.Embed(c.vocab_size, c.d_model, dtype=c.dtype,
                              param_dtype=c.param_dtype, embedding_init=_init)
        block = Block
        if c.remat != "none":
            block = nn.remat(Block, policy=remat_policy(c.remat), prevent_cse=not c.scan_layers)
        if c.scan_layers:
            self.layers = nn.scan(block, variable_axes={"params": 0},
                                  split_rngs={"params": True},
                                  in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                                  length=c.n_layers)(c, self.mesh)
        else:
            self.blocks = [block(c, self.mesh) for _ in range(c.n_layers)]
        self.final_norm = RMSNorm(eps=c.rms_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype)
        if not c.tie_embeddings:
            self.lm_head = self.param("lm_head", _init, (c.d_model, c.vocab_size), c.param_dtype)

    def hidden(self, tokens_BT, positions_BT, segment_ids_BT, prefix_ids_BT=None):
        """`prefix_ids_BT`: the shared-prompt layout's (`lrl.data.shared_prompt`), or None."""
        x = constrain(self.embed(tokens_BT), self.mesh)
        return self.layers_and_norm(x, positions_BT, segment_ids_BT, prefix_ids_BT)

    def layers_and_norm(self, x_BTD, positions_BT, segment_ids_BT, prefix_ids_BT=None):
        """The decoder layers and the final norm on input embeddings (the VL decoder's
        entry: it splices visual rows into the embeddings first)."""
        x = x_BTD
        stacked = (None if not self.cfg.scan_layers or self.is_initializing()
                   else self.variables["params"]["layers"])
        sink = None if stacked is None else grad_sink.take(stacked)
        if sink is not None:  # an accumulating step's layers (lrl.models.grad_sink)
            x = grad_sink.layers(sink, functools.partial(_block, self.cfg, self.mesh), stacked,
                                 x, (positions_BT, segment_ids_BT, prefix_ids_BT))
        elif self.cfg.scan_layers:
            x, _ = self.layers(x, positions_BT, segment_ids_BT, prefix_ids_BT)
        else:
            for blk in self.blocks:
                x, _ = blk(x, positions_BT, segment_ids_BT, prefix_ids_BT)
        return self.final_norm(x)

    def unembedding(self):
        """The [D, V] output matrix (the embedding's transpose when tied)."""
        if self.cfg.tie_embeddings:
            return self.embed.embedding.T
        return self.lm_head

    def __call__(self, tokens_BT, positions_BT, segment_ids_BT):
        x = self.hidden(tokens_BT, positions_BT, segment_ids_BT)
        return logits_from_hidden(x, self.unembedding())


def _block(cfg, mesh, params, x_BTD, positions_BT, segment_ids_BT, prefix_ids_BT):
    """One layer as a function of its weights (`lrl.models.grad_sink`'s layer)."""
    # parent=None: a module of its own, not a submodule of the decoder that calls this
    return Block(cfg, mesh, parent=None).apply({"params": params}, x_BTD, positions_BT,
                                               segment_ids_BT, prefix_ids_BT)[0]


def logits_from_hidden(x_BTD, w_DV):
    return jnp.einsum("btd,dv->btv", x_BTD, w_DV.astype(x_BTD.dtype),
                      preferred_element_type=jnp.float32)


def default_positions(tokens_BT, segment_ids_BT: Optional[jax.Array]):
    """Positions restart at 0 at every segment start (packed rows)."""
    B, T = tokens_BT.shape
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if segment_ids_BT is None:
        return idx
    start = jnp.concatenate([jnp.ones((B, 1), bool),
                             segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    seg_start = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    return idx - seg_start
