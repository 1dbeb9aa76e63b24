"""Attention that reads keys and values straight from the paged KV pool.

The pool of one model is k_pages and v_pages of shape [K, L * num_pages, page_size, H]: layer
l's page p lives at index l * num_pages + p. Folding the layer into the page index lets the
scanned layer loop hand the whole pool to a kernel with a per-layer offset instead of slicing
out (and so copying) one layer's pages at every step.

Three implementations, numerically the same attention:
- `pallas_gqa`: our Pallas GPU kernel (`lrl.rollout.paged_kernel`; decode only, one query per
  row): q unpadded, the output normalised in the kernel;
- `pallas`: the Pallas GPU paged-attention kernel of jax (decode only, one query per row);
- `paged_attention_xla`: a loop over blocks of pages with an online softmax, any number of
  queries per row (decode and chunked prefill), for CPU, TPU or sharded runs. It gathers one
  block of pages at a time, never the whole cache.

B batch rows · T query positions · S key/value positions · N query heads · K key/value heads ·
H head dim · Q query heads per kv head · Y pages per slot.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from lrl.rollout import paged_kernel

IMPLS = ("pallas_gqa", "pallas", "xla")
PALLAS = ("pallas_gqa", "pallas")   # GPU kernels; each has an "_interpret" twin for CPU tests


@functools.lru_cache(maxsize=None)
def _pallas_module():
    """jax's Pallas GPU paged attention, or None where it cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the module is marked deprecated in jax 0.11
            from jax.experimental.pallas.ops.gpu import paged_attention as module
        return module
    except Exception:  # noqa: BLE001 - any import failure means "use the XLA path"
        return None


def default_impl(mesh=None) -> str:
    """Our Pallas kernel on a single GPU (it read the KV faster than jax's: docs/benchmark-history.md,
    "Decode kernel, joined qkv, cuBLAS matmuls, sampler: fourth session", lease 4); the XLA
    loop elsewhere (CPU, TPU, or a multi-device mesh,
    where the custom call would need a shard_map of its own)."""
    single = mesh is None or mesh.size == 1
    if jax.default_backend() == "gpu" and single:
        return "pallas_gqa"
    return "xla"


def write_kv(k_pages, v_pages, k_BTKH, v_BTKH, page_BT, offset_BT):
    """Writes each token's k and v at (page, offset); `page_BT` already includes the layer's
    base index. Rows aimed at the null page may collide there: its contents are never read,
    so the scatters are declared unique, which XLA writes faster (docs/benchmark-history.md, "Sixth
    session", "The qkv bias and the page writes")."""
    k = jnp.moveaxis(k_BTKH, 2, 0).astype(k_pages.dtype)   # [K, B, T, H]
    v = jnp.moveaxis(v_BTKH, 2, 0).astype(v_pages.dtype)
    return (k_pages.at[:, page_BT, offset_BT].set(k, unique_indices=True),
            v_pages.at[:, page_BT, offset_BT].set(v, unique_indices=True))


def paged_attention_xla(q_BTNH, q_pos_BT, k_pages, v_pages, table_BY, kv_len_B, layer_base,
                        pages_per_block: int):
    """Causal attention of queries at positions `q_pos_BT` over the first `kv_len_B` tokens of
    each row's pages (a key is visible when its position <= the query's)."""
    B, T, N, H = q_BTNH.shape
    K, _, page_size, _ = k_pages.shape
    Y = table_BY.shape[1]
    if Y % pages_per_block:
        raise ValueError(f"pages per row {Y} is not a multiple of pages_per_block "
                         f"{pages_per_block}")
    Q = N // K
    block = pages_per_block * page_size
    scale = jnp.float32(1.0 / (H ** 0.5))
    q = q_BTNH.reshape(B, T, K, Q, H)
    num_blocks = (jnp.max(kv_len_B) + block - 1) // block  # only blocks that hold a key

    def body(j, carry):
        m, l, acc = carry                                   # [B,K,Q,T], [B,K,Q,T], [..,H]
        # [B, pages_per_block]: the block's pages of every row
        pages = jax.lax.dynamic_slice_in_dim(table_BY, j * pages_per_block,
                                             pages_per_block, axis=1) + layer_base
        k = k_pages[:, pages].reshape(K, B, block, H)
        v = v_pages[:, pages].reshape(K, B, block, H)
        s = jnp.einsum("btkqh,kbsh->bkqts", q, k, preferred_element_type=jnp.float32) * scale
        k_pos = j * block + jnp.arange(block)
        visible_BTS = ((k_pos[None, None, :] <= q_pos_BT[:, :, None])
                       & (k_pos[None, None, :] < kv_len_B[:, None, None]))
        visible = visible_BTS[:, None, None]
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(visible, jnp.exp(s - m_safe[..., None]), 0.0)
        correction = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "bkqts,kbsh->bkqth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((B, K, Q, T), -jnp.inf, jnp.float32), jnp.zeros((B, K, Q, T), jnp.float32),
            jnp.zeros((B, K, Q, T, H), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]         # a row with no key gives zeros
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q_BTNH.dtype)


def paged_attention_pallas(q_BNH, k_pages, v_pages, table_BY, kv_len_B, layer_base, *,
                           pages_per_block: int, k_splits: int, warps: int = 8,
                           stages: int = 2, interpret: bool = False):
    """One query per row through jax's Pallas GPU kernel. The kernel does not scale the
    scores, so q is scaled here; `interpret=True` runs it on CPU (for tests). `warps` and
    `stages` are Triton's num_warps and num_stages (jax's defaults: 8 and 2)."""
    module = _pallas_module()
    if module is None:
        raise RuntimeError("jax.experimental.pallas.ops.gpu.paged_attention cannot be imported "
                           "in this jax; use attention_impl='xla'")
    Y = table_BY.shape[1]
    if Y % (k_splits * pages_per_block):
        raise ValueError(f"pages per row {Y} must be a multiple of k_splits * pages_per_block "
                         f"= {k_splits} * {pages_per_block}")
    H = q_BNH.shape[-1]
    q = (q_BNH.astype(jnp.float32) * (1.0 / H ** 0.5)).astype(k_pages.dtype)
    out = module.paged_attention(q, k_pages, v_pages, table_BY + layer_base,
                                 kv_len_B.astype(jnp.int32), pages_per_compute_block=pages_per_block,
                                 k_splits=k_splits, num_warps=warps, num_stages=stages,
                                 interpret=interpret)
    return out.astype(q_BNH.dtype)


def decode_attention(q_BTNH, k_pages, v_pages, table_BY, kv_len_B, layer_base, *, impl: str,
                     pages_per_block: int, k_splits: int = 1, warps: int = 4, stages: int = 1,
                     kv_per_program: int = 1):
    """One new token per row (T == 1) attending to its row's first `kv_len_B` tokens.
    `kv_per_program` is for pallas_gqa only (0: as many kv heads as fill one q tile)."""
    if impl in ("pallas_gqa", "pallas_gqa_interpret"):
        out = paged_kernel.paged_decode_attention(
            q_BTNH[:, 0], k_pages, v_pages, table_BY, kv_len_B, layer_base,
            pages_per_block=pages_per_block, k_splits=k_splits, warps=warps, stages=stages,
            kv_per_program=kv_per_program, interpret=impl.endswith("_interpret"))
        return out[:, None]
    if impl in ("pallas", "pallas_interpret"):
        return paged_attention_pallas(q_BTNH[:, 0], k_pages, v_pages, table_BY, kv_len_B,
                                      layer_base, pages_per_block=pages_per_block,
                                      k_splits=k_splits, warps=warps, stages=stages,
                                      interpret=impl == "pallas_interpret")[:, None]
    if impl == "xla":
        return paged_attention_xla(q_BTNH, (kv_len_B - 1)[:, None], k_pages, v_pages,
                                   table_BY, kv_len_B, layer_base, pages_per_block)
    raise ValueError(f"decode attention impl={impl!r}; choose one of {IMPLS}")


def packed_self_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT):
    """Causal attention within each of the prompts packed into a row (nothing of them is in the
    pages yet): cuDNN's packed layout on GPU in half precision, else the blockwise XLA kernel
    (memory per block, not per row squared: a row may be thousands of tokens). Padding is
    segment 0, after the prompts: it sees only itself."""
    from lrl.models import flash
    return flash.dense_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)


def chunk_self_attention(q_BTNH, k_BTKH, v_BTKH):
    """Causal attention of a prompt's first chunk over itself (nothing is in the pages yet):
    cuDNN flash attention on GPU in half precision, else the training model's XLA path.
    Padding sits after the real tokens, so causality keeps it out of their view."""
    if jax.default_backend() == "gpu" and q_BTNH.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True,
                                                implementation="cudnn")
        except Exception:  # noqa: BLE001 - an unsupported shape falls back to XLA
            pass
    from lrl.models.attention import xla_attention
    B, T = q_BTNH.shape[:2]
    return xla_attention(q_BTNH, k_BTKH, v_BTKH, jnp.ones((B, T), jnp.int32))
