"""The rollout engine's device half: its configuration, the decode state pytree and the
jitted pure steps (prefill a chunk, decode steps, insert slots, deactivate) that
`lrl.rollout.engine.Engine` drives from the host.

B batch rows (a decode step's rows are the engine's slots) · T query positions · C chunk ·
D model width · F MLP width · V vocabulary · N query heads · K key/value heads · H head dim ·
L layers · J joined projections · Y pages per slot.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from lrl.models.decoder import Block, constrain, logits_from_hidden
from lrl.models.forward import unembedding
from lrl.models.layers import RMSNorm, rope_angles
from lrl.rollout import paged_attention as pa
from lrl.rollout import paged_kernel
from lrl.rollout.pages import NULL_PAGE, page_of, pages_for
from lrl.rollout.sampling import IMPLS as SAMPLING_IMPLS
from lrl.rollout.sampling import SamplingParams, sample, sample_keys
from lrl.rollout.weights import is_decode_layout


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 1024            # pool size per layer, null page included
    max_slots: int = 8               # B: rows of every decode step
    max_pages_per_slot: int = 64     # Y before rounding up to the kernels' block multiple
    prefill_chunk: int = 4096        # C: a prefill row's tokens (power of two); longer prompts
                                     # go in chunks of C that attend to their pages
    # R: rows of every prefill call, so that a call is always [R, C] and compiles once (0: as
    # many as `prefill_batch_tokens` allow). Short prompts share rows (`prefill_packed`).
    prefill_rows: int = 0
    # With prefill_rows: a call whose prompts fill at most this many packed rows is
    # [prefill_narrow_rows, C] instead (0: never). Slots freed during a rollout admit a prompt
    # or two at a time; a call of every row cost them as much as a full one.
    prefill_narrow_rows: int = 0
    # With prefill_rows: text prompts that each fit S = prefill_short_chunk tokens go in calls
    # [1, S] (one a packed row of S) when those hold at most half the tokens of the call they
    # replace (0: never). C is sized for the longest prompt a run may prefill (a carried
    # sample's tokens so far, with partial rollouts), so a call of C rows for a few fresh
    # prompts of tens of tokens computed C tokens each time (11 ms of a 1.5B model's step, a
    # dozen times a rollout: docs/benchmark-history.md, "Fifteenth session").
    prefill_short_chunk: int = 0
    # Tokens of one prefill call (R x C when prefill_rows is 0): 256 prompts of 512 tokens
    # prefilled faster in calls of 16,384 tokens than of 4,096 (docs/benchmark-history.md, "Fifth
    # session", "Prefill: decode-layout weights and wider calls").
    prefill_batch_tokens: int = 16384
    # Whole-prompt prefill: a prompt of n cached tokens, n > C, with some L >= n here goes in
    # one [1, L] `prefill_packed` call (L the smallest such), attention over the whole prompt
    # at once (cuDNN on GPU), instead of chunk after chunk of C, each of which reads the
    # earlier chunks' pages through the XLA paged path (5.06 s for a 33K-token video prompt
    # on one H200 where the update's forward and backward took 4.88: docs/benchmark-history.md, "Video
    # frames (issue 9)"). Sorted, each > prefill_chunk; each length compiles once
    # (`Engine.compile_prefill`). () or a longer prompt: chunks. `whole_prefill_lengths`.
    prefill_lengths: tuple[int, ...] = ()
    eos_ids: tuple[int, ...] = ()    # tokens that end a sample (kept in its output)
    sampling: SamplingParams = SamplingParams()
    attention_impl: Optional[str] = None  # None: pallas_gqa on one GPU, else XLA
    # The sampler's pass over the logits: None follows attention_impl, "pallas" with a Pallas
    # kernel ("pallas_interpret" with the interpreted one), else "xla". The kernel reads the
    # logits once where XLA's two reductions read them twice, and decode steps ran faster with
    # it (docs/benchmark-history.md, "Eighth session").
    sampling_impl: Optional[str] = None
    # Decode kernel launch: at 256 slots x 640 tokens (Qwen2.5-1.5B shapes) our kernel with 4
    # pages a block, 4 warps, 1 stage and one kv head a program was the fastest setting, faster
    # than jax's kernel at its defaults (8 pages, 8 warps, 2 stages) and at its best
    # (docs/benchmark-history.md, "Decode kernel, joined qkv, cuBLAS matmuls, sampler: fourth session").
    # Software pipelining hurts: one stage holds less shared memory, so more programs share
    # an SM.
    decode_block_pages: int = 4      # pages per compute block of decode attention
    prefill_block_pages: int = 64    # pages per block when a prefill chunk reads the pages
    # The same for a multi-turn observation's call (`Engine.run_extend`): a few dozen tokens a
    # row over histories of hundreds, where a block of prefill_block_pages computes and masks
    # scores for keys most rows do not have. 0: prefill_block_pages. On the H100 the block did
    # not matter (observations 2.46 s at 32 pages, 2.49 s at 64: fewer masked keys, more loop
    # trips; docs/benchmark-history.md, "Twenty-ninth session").
    extend_block_pages: int = 0
    pallas_k_splits: int = 4         # splits of the kv axis in the Pallas kernel
    pallas_warps: int = 4            # Triton warps per program of the Pallas kernel
    pallas_stages: int = 1           # Triton software-pipelining stages of its page loop
    pallas_kv_per_program: int = 1   # pallas_gqa: kv heads per program (0: fill one q tile)
    layer_unroll: int = 1            # unroll of the layer scan (fewer loop trips per step)
    # pallas_gqa with the decode layout's joined qkv: the kernel also adds the qkv bias,
    # applies q/k norm and RoPE and writes the new token's k and v (`fused_decode_attention`),
    # one launch a layer instead of four. Off: its steps were slower than unfused ones at every
    # block size tried, 8 pages a block the least slow (docs/benchmark-history.md, "Sixth session", "A
    # fused decode kernel").
    fused_decode: bool = False
    # Narrower decode programs for a rollout's tail: once no sample waits and at most W slots
    # are live, a call decodes just those W rows (`decode_rows`), each width compiled once.
    # Every row of a decode step costs its share of the matmuls and the sampler, live or not.
    narrow_widths: tuple[int, ...] = ()
    # Multi-turn: tokens of one call that prefills observations into waiting samples' pages
    # (`Engine.run_extend`, [R, C]: C a power of two holding the observation, R this over C).
    # One program per C; R fixed so that a round's few resumed samples do not compute a
    # prompt prefill's thousands of padding rows.
    turn_prefill_tokens: int = 1024

    def __post_init__(self):
        if self.prefill_chunk < 1 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two, got {self.prefill_chunk}")
        if self.prefill_rows < 0:
            raise ValueError(f"prefill_rows must be >= 0, got {self.prefill_rows}")
        if self.prefill_narrow_rows and not 0 < self.prefill_narrow_rows < self.prefill_rows:
            raise ValueError(f"prefill_narrow_rows must be 0 or in [1, prefill_rows="
                             f"{self.prefill_rows}), got {self.prefill_narrow_rows}")
        S = self.prefill_short_chunk
        if S and (S & (S - 1) or S >= self.prefill_chunk or not self.prefill_rows):
            raise ValueError(f"prefill_short_chunk must be 0 or, with prefill_rows, a power of "
                             f"two below prefill_chunk={self.prefill_chunk}, got {S}")
        if list(self.prefill_lengths) != sorted(set(self.prefill_lengths)) or any(
                n <= self.prefill_chunk for n in self.prefill_lengths):
            raise ValueError(f"prefill_lengths must be increasing and longer than "
                             f"prefill_chunk={self.prefill_chunk}, got {self.prefill_lengths}")
        if self.prefill_batch_tokens < 1:
            raise ValueError(f"prefill_batch_tokens must be >= 1, got {self.prefill_batch_tokens}")
        if self.page_size < 1 or self.max_slots < 1 or self.max_pages_per_slot < 1:
            raise ValueError(f"page_size, max_slots and max_pages_per_slot must be positive: "
                             f"{self.page_size}, {self.max_slots}, {self.max_pages_per_slot}")
        if self.pallas_warps < 1 or self.pallas_warps & (self.pallas_warps - 1) \
                or self.pallas_stages < 1:
            raise ValueError(f"pallas_warps must be a power of two and pallas_stages >= 1: "
                             f"{self.pallas_warps}, {self.pallas_stages}")
        if self.pallas_kv_per_program < 0:
            raise ValueError(f"pallas_kv_per_program must be >= 0 (0: automatic), got "
                             f"{self.pallas_kv_per_program}")
        if any(not 1 <= w < self.max_slots for w in self.narrow_widths):
            raise ValueError(f"narrow_widths must lie in [1, max_slots={self.max_slots}), got "
                             f"{self.narrow_widths}")
        if self.attention_impl not in (None, *pa.IMPLS, *(f"{k}_interpret" for k in pa.PALLAS)):
            raise ValueError(f"attention_impl={self.attention_impl!r}; choose None or {pa.IMPLS}")
        if self.sampling_impl not in (None, *SAMPLING_IMPLS):
            raise ValueError(f"sampling_impl={self.sampling_impl!r}; choose None or "
                             f"{SAMPLING_IMPLS}")

    @property
    def rows_per_prefill(self) -> int:
        """R of a prefill call [R, C]."""
        return self.prefill_rows or max(1, self.prefill_batch_tokens // self.prefill_chunk)

    def whole_length(self, cached: int):
        """L of the whole-prompt call for a prompt of `cached` tokens, or None: chunks."""
        return next((n for n in self.prefill_lengths if n >= cached), None)

    @property
    def extend_pages_per_block(self) -> int:
        """Pages per block when an observation's call reads the pages."""
        return self.extend_block_pages or self.prefill_block_pages

    @property
    def pages_per_slot(self) -> int:
        """Y, rounded up so that both attention paths tile it exactly."""
        align = int(np.lcm.reduce([self.prefill_block_pages, self.extend_pages_per_block,
                                   self.decode_block_pages * self.pallas_k_splits]))
        return pages_for(self.max_pages_per_slot, align) * align


def whole_prefill_lengths(chunk: int, longest: int, max_tokens: int) -> tuple[int, ...]:
    """`EngineConfig.prefill_lengths` for prompts of up to `longest` cached tokens: 2C, 4C,
    ... below the longest, then the longest rounded up to min(C, 1024); none above
    `max_tokens` (a prefill call's token budget, `prefill_tokens`: a whole-prompt call then
    holds no more tokens, and needs about as much memory, as a full packed call). () when
    every prompt fits one chunk. A prompt pads to at most twice its tokens: the lengths are
    few, and each compiles once."""
    top = min(-(-longest // min(chunk, 1024)) * min(chunk, 1024), max_tokens)
    if longest <= chunk or top <= chunk:
        return ()
    out, n = [], 2 * chunk
    while n < top:
        out.append(n)
        n *= 2
    return tuple(out) + (top,)


class DecodeState(NamedTuple):
    k_pages: jax.Array      # [K, L * num_pages, page_size, H]
    v_pages: jax.Array
    page_table: jax.Array   # [B, Y] int32, unused entries at the null page
    lengths: jax.Array      # [B] int32: tokens in the cache (= position of `tokens`)
    tokens: jax.Array       # [B] int32: the next token to feed
    active: jax.Array       # [B] bool
    remaining: jax.Array    # [B] int32: tokens still to sample
    sample_ids: jax.Array   # [B] int32: who the slot samples for (key derivation)
    steps: jax.Array        # [B] int32: tokens sampled so far (key derivation)
    rope_delta: jax.Array   # [B] int32: rotary position minus cache index (M-RoPE prompts)


class StepOutput(NamedTuple):
    tokens: jax.Array       # [n, B] int32
    logps: jax.Array        # [n, B] float32
    valid: jax.Array        # [n, B] bool: the slot was live and sampled this token
    active: jax.Array       # [B] bool: the slot is still live after the call's last step


# ----------------------------------------------------------------------------- device steps

def _embed(cfg, params, tokens):
    return jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(cfg.dtype)


def run_layers(cfg, params, x_BTD, pos_BT, k_pages, v_pages, page_BT, offset_BT, attend,
               unroll=1, mesh=None, pool_sharding=None):
    """The training Block's two halves around a paged write and a paged attention. Stacked
    layers (the training layout) are scanned; a tuple of layers (`weights.decode_params`)
    is unrolled, so no layer is sliced out of a stack inside the step. With a mesh (the
    sequence-parallel prefill), activations keep the training layout between layers and the
    pool keeps `pool_sharding`."""
    num_pages = k_pages.shape[1] // cfg.n_layers
    block = Block(cfg, mesh)

    def body(carry, xs):
        x, kp, vp = carry
        layer_p, layer = xs
        if "qkv" in layer_p:
            q, k, v = block.apply({"params": layer_p}, x, pos_BT, layer_p["qkv"],
                                  method=_qkv_fused)
        else:
            q, k, v = block.apply({"params": layer_p}, x, pos_BT, method=Block.qkv)
        base = layer * num_pages
        kp, vp = pa.write_kv(kp, vp, k, v, page_BT + base, offset_BT)
        if pool_sharding is not None:
            kp = jax.lax.with_sharding_constraint(kp, pool_sharding)
            vp = jax.lax.with_sharding_constraint(vp, pool_sharding)
        attn = attend(q, k, v, kp, vp, base)
        if "gate_up" in layer_p:
            x = block.apply({"params": layer_p}, x, attn, layer_p["gate_up"],
                            method=_finish_fused)
        else:
            x = block.apply({"params": layer_p}, x, attn, method=Block.finish)
        return (constrain(x, mesh), kp, vp), None

    if is_decode_layout(params):
        carry = (x_BTD, k_pages, v_pages)
        for layer, layer_p in enumerate(params["layers"]):
            carry, _ = body(carry, (layer_p, layer))
        return carry
    xs = (params["layers"], jnp.arange(cfg.n_layers, dtype=jnp.int32))
    (x, k_pages, v_pages), _ = jax.lax.scan(body, (x_BTD, k_pages, v_pages), xs, unroll=unroll)
    return x, k_pages, v_pages


def _joined(h_BTD, kernel, bias=None):
    """One of the decode layout's joined projections: kernel [D, J, H] for qkv or [D, J, F]
    for gate and up (bias [J, H] or [J, F]) -> [B, T, J, H] or [B, T, J, F]."""
    y = jnp.einsum("btd,dj...->btj...", h_BTD, kernel.astype(h_BTD.dtype))
    return y if bias is None else y + bias.astype(h_BTD.dtype)


def _qkv_fused(block: Block, x_BTD, pos_BT, qkv):
    """Block.qkv with the decode layout's one [D, J, H] projection weight (J = N + 2K). A bias
    is added in fp32, in the fusions that rotate q and k and write k and v: added to the
    matmul, it became cuBLAS's C operand, a [B, T, J, H] broadcast written by a kernel of its
    own at every layer (docs/benchmark-history.md, "Sixth session", "The qkv bias and the page writes")."""
    N, K = block.cfg.n_heads, block.cfg.n_kv_heads
    h = block.input_norm(x_BTD)
    y = _joined(h, qkv["kernel"])
    if "bias" in qkv:
        y = y.astype(jnp.float32) + qkv["bias"].astype(jnp.float32)
    q, k, v = block.rotate(y[:, :, :N], y[:, :, N:N + K], y[:, :, N + K:], pos_BT)
    return q.astype(h.dtype), k.astype(h.dtype), v.astype(h.dtype)


def _finish_fused(block: Block, x_BTD, attn_BTNH, gate_up):
    """Block.finish with the decode layout's one [D, J, F] gate-and-up weight (J = 2)."""
    x = x_BTD + block.o_proj(attn_BTNH)
    gu = _joined(block.post_attn_norm(x), gate_up["kernel"], gate_up.get("bias"))
    return x + block.down_proj(jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1])


# cuBLAS for every matmul of prefill and decode: XLA's Triton gemm fusions (a matmul fused with
# its bias, or joined with its neighbours) were slower at decode's 256-row matmuls
# (docs/benchmark-history.md, "Decode kernel, joined qkv, cuBLAS matmuls, sampler: fourth session", lease
# 2; autotuned against cuBLAS, again slower: "Seventh session", "The levers").
_GEMM_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
# The decode loop also runs as one CUDA graph: with WHILE and CONDITIONAL among the command
# buffer types, the device evaluates the loop condition itself, so a step no longer waits for
# the host to read it back and launch the next. That lets the host collect one decode call
# while the next runs (`generate`). With that overlap, steps were faster with these types than
# without, where the host waits on every step's condition (docs/benchmark-history.md, "Sixth session",
# "Overlap").
_DECODE_OPTIONS = {**_GEMM_OPTIONS, "xla_gpu_enable_command_buffer":
                   "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}


@functools.partial(jax.jit, static_argnames=("cfg", "ecfg", "first", "block_pages"),
                   donate_argnames=("k_pages", "v_pages"), compiler_options=_GEMM_OPTIONS)
def prefill_chunk(cfg, ecfg, params, k_pages, v_pages, tokens_BC, start_B, n_valid_B, table_BY,
                  first: bool, embeds_BCD=None, rope_pos_3BC=None, block_pages: int = 0):
    """Writes the KV of tokens [start, start + n_valid) of each row into its pages. `first`:
    every row starts at 0, so the chunk attends only to itself (flash attention on GPU).
    `block_pages`: pages per block of the paged read (0: `ecfg.prefill_block_pages`).
    Multimodal rows pass their input embeddings and M-RoPE positions instead of using the
    token embeddings and the cache index as rotary position."""
    C = tokens_BC.shape[1]
    pos_BC = start_B[:, None] + jnp.arange(C, dtype=jnp.int32)
    valid_BC = jnp.arange(C)[None, :] < n_valid_B[:, None]
    page_BC, offset_BC = page_of(table_BY, pos_BC, valid_BC, ecfg.page_size)
    kv_len_B = start_B + n_valid_B

    def attend(q, k, v, kp, vp, base):
        if first:
            return pa.chunk_self_attention(q, k, v)
        return pa.paged_attention_xla(q, pos_BC, kp, vp, table_BY, kv_len_B, base,
                                      block_pages or ecfg.prefill_block_pages)

    x_BCD = (_embed(cfg, params, tokens_BC) if embeds_BCD is None
             else embeds_BCD.astype(cfg.dtype))
    rope_pos = pos_BC if rope_pos_3BC is None else rope_pos_3BC
    _, k_pages, v_pages = run_layers(cfg, params, x_BCD, rope_pos,
                                      k_pages, v_pages, page_BC, offset_BC, attend,
                                      ecfg.layer_unroll)
    return k_pages, v_pages


@functools.partial(jax.jit, static_argnames=("cfg", "ecfg"),
                   donate_argnames=("k_pages", "v_pages"), compiler_options=_GEMM_OPTIONS)
def prefill_packed(cfg, ecfg, params, k_pages, v_pages, tokens_BC, positions_BC, segment_ids_BC,
                   page_BC, offset_BC, embeds_BCD=None, rope_pos_3BC=None):
    """Writes the KV of the prompts packed into rows: each token at its page and offset, each
    prompt attending causally to itself (segment ids, 0 for padding, which writes into the
    null page). One shape for any mix of prompt lengths, so it compiles once. Multimodal rows
    pass their input embeddings and M-RoPE positions."""
    def attend(q, k, v, kp, vp, base):
        return pa.packed_self_attention(q, k, v, segment_ids_BC)

    x_BCD = (_embed(cfg, params, tokens_BC) if embeds_BCD is None
             else embeds_BCD.astype(cfg.dtype))
    rope_pos = positions_BC if rope_pos_3BC is None else rope_pos_3BC
    _, k_pages, v_pages = run_layers(cfg, params, x_BCD, rope_pos, k_pages, v_pages, page_BC,
                                     offset_BC, attend, ecfg.layer_unroll)
    return k_pages, v_pages


def _fuses_decode(ecfg, params) -> bool:
    return (ecfg.fused_decode and ecfg.attention_impl in ("pallas_gqa", "pallas_gqa_interpret")
            and is_decode_layout(params) and "qkv" in params["layers"][0])


def _fused_layers(cfg, ecfg, params, x_B1D, rope_B1, state, page_B, offset_B, kv_len_B):
    """The decode layout's layers with `paged_kernel.fused_decode_attention`: per layer the
    qkv matmul, one kernel (bias, q/k norm, RoPE, page write, attention), then Block.finish.
    The RoPE angles are the same at every layer, so they are computed once."""
    block = Block(cfg)
    H2 = cfg.head_dim // 2
    cos, sin = rope_angles(cfg, rope_B1)
    cos_BH2, sin_BH2 = cos[:, 0, :H2], sin[:, 0, :H2]
    kp, vp = state.k_pages, state.v_pages
    num_pages = kp.shape[1] // cfg.n_layers
    for layer, lp in enumerate(params["layers"]):
        h = block.apply({"params": lp}, x_B1D, method=lambda m, x: m.input_norm(x))
        y_BJH = _joined(h, lp["qkv"]["kernel"])[:, 0]
        norms = ((lp["q_norm"]["scale"], lp["k_norm"]["scale"]) if cfg.qk_norm
                 else (None, None))
        attn_BNH, kp, vp = paged_kernel.fused_decode_attention(
            y_BJH, lp["qkv"].get("bias"), *norms, cos_BH2, sin_BH2, kp, vp, state.page_table,
            kv_len_B, page_B, offset_B, layer * num_pages, n_heads=cfg.n_heads,
            eps=cfg.rms_norm_eps,
            pages_per_block=ecfg.decode_block_pages, k_splits=ecfg.pallas_k_splits,
            warps=ecfg.pallas_warps, stages=ecfg.pallas_stages,
            kv_per_program=ecfg.pallas_kv_per_program,
            interpret=ecfg.attention_impl.endswith("_interpret"))
        x_B1D = block.apply({"params": lp}, x_B1D, attn_BNH[:, None], lp["gate_up"],
                            method=_finish_fused)
    return x_B1D, kp, vp


def _decode_step(cfg, ecfg, params, state: DecodeState, rng):
    live = state.active
    pos_B1 = state.lengths[:, None]
    page_B1, offset_B1 = page_of(state.page_table, pos_B1, live[:, None], ecfg.page_size)
    kv_len_B = jnp.where(live, state.lengths + 1, 0)

    def attend(q, k, v, kp, vp, base):
        return pa.decode_attention(q, kp, vp, state.page_table, kv_len_B, base,
                                   impl=ecfg.attention_impl, pages_per_block=ecfg.decode_block_pages,
                                   k_splits=ecfg.pallas_k_splits, warps=ecfg.pallas_warps,
                                   stages=ecfg.pallas_stages,
                                   kv_per_program=ecfg.pallas_kv_per_program)

    rope_B1 = pos_B1 + state.rope_delta[:, None]   # text tokens: one position for t, h, w
    x = _embed(cfg, params, state.tokens[:, None])
    if _fuses_decode(ecfg, params):
        x, kp, vp = _fused_layers(cfg, ecfg, params, x, rope_B1, state, page_B1[:, 0],
                                  offset_B1[:, 0], kv_len_B)
    else:
        x, kp, vp = run_layers(cfg, params, x, rope_B1, state.k_pages, state.v_pages, page_B1,
                               offset_B1, attend, ecfg.layer_unroll)
    norm = RMSNorm(eps=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    x = norm.apply({"params": params["final_norm"]}, x)
    logits_BV = logits_from_hidden(x, unembedding(cfg, params))[:, 0]
    keys = sample_keys(rng, state.sample_ids, state.steps)
    tok_B, logp_B = sample(logits_BV, keys, ecfg.sampling, ecfg.sampling_impl or "xla")
    stop = (jnp.isin(tok_B, jnp.asarray(ecfg.eos_ids, jnp.int32)) if ecfg.eos_ids
            else jnp.zeros_like(live))
    remaining = state.remaining - live
    state = state._replace(
        k_pages=kp, v_pages=vp,
        lengths=state.lengths + live, tokens=jnp.where(live, tok_B, state.tokens),
        active=live & ~stop & (remaining > 0), remaining=remaining, steps=state.steps + live)
    return state, (tok_B, logp_B, live)


def _decode_loop(cfg, ecfg, params, state: DecodeState, rng, num_steps: int):
    """Up to `num_steps` decode steps of every row of `state`; stops early once none is live."""
    B = state.tokens.shape[0]
    out = StepOutput(jnp.zeros((num_steps, B), jnp.int32), jnp.zeros((num_steps, B), jnp.float32),
                     jnp.zeros((num_steps, B), bool), state.active)

    def cond(c):
        i, st, _ = c
        return (i < num_steps) & jnp.any(st.active)

    def body(c):
        i, st, o = c
        st, (tok, logp, live) = _decode_step(cfg, ecfg, params, st, rng)
        o = StepOutput(o.tokens.at[i].set(tok), o.logps.at[i].set(logp), o.valid.at[i].set(live),
                       st.active)
        return i + 1, st, o

    _, state, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state, out))
    return state, out


@functools.partial(jax.jit, static_argnames=("cfg", "ecfg", "num_steps"),
                   donate_argnames=("state",), compiler_options=_DECODE_OPTIONS)
def decode_steps(cfg, ecfg, params, state: DecodeState, rng, num_steps: int):
    """Up to `num_steps` decode steps of all B slots; stops early once no slot is live."""
    return _decode_loop(cfg, ecfg, params, state, rng, num_steps)


_SLOT_FIELDS = DecodeState._fields[2:]   # the per-slot arrays: all but the pool


@functools.partial(jax.jit, static_argnames=("cfg", "ecfg", "num_steps"),
                   donate_argnames=("state",), compiler_options=_DECODE_OPTIONS)
def decode_rows(cfg, ecfg, params, state: DecodeState, rng, rows_W, num_steps: int):
    """`decode_steps` for the W slots `rows_W` alone (distinct; every slot left out must be
    idle): their rows are gathered into a [W] batch, decoded, and scattered back, and the
    output is [num_steps, B] as `decode_steps`' is. In a rollout's tail, when a few slots are
    still live, a step's matmuls and sampler then run on W rows instead of B; the pool is
    shared, so no page moves. Tokens are the same: draws are keyed by (sample, step)."""
    B = state.tokens.shape[0]
    narrow = state._replace(**{f: getattr(state, f)[rows_W] for f in _SLOT_FIELDS})
    narrow, o = _decode_loop(cfg, ecfg, params, narrow, rng, num_steps)
    wide = lambda a, x: a.at[..., rows_W].set(x)  # noqa: E731
    n = num_steps
    state = narrow._replace(**{f: getattr(state, f).at[rows_W].set(getattr(narrow, f))
                               for f in _SLOT_FIELDS})
    out = StepOutput(wide(jnp.zeros((n, B), jnp.int32), o.tokens),
                     wide(jnp.zeros((n, B), jnp.float32), o.logps),
                     wide(jnp.zeros((n, B), bool), o.valid), state.active)
    return state, out


@functools.partial(jax.jit, static_argnames=("num_layers",), donate_argnames=("state",))
def insert_slots(state: DecodeState, slot_B, row_BY, length_B, token_B, remaining_B, sample_B,
                 copy_src_B, copy_dst_B, num_layers: int, delta_B=None, steps_B=None):
    """Copies each new slot's partial prompt page (all layers) and sets its row. Padding rows
    carry slot index max_slots (out of range: dropped) and copy the null page onto itself.
    `steps_B`: tokens each sample has sampled before (its draws go on from there: a multi-turn
    sample's next turn)."""
    num_pages = state.k_pages.shape[1] // num_layers
    base_L1 = jnp.arange(num_layers, dtype=jnp.int32)[:, None] * num_pages
    src, dst = base_L1 + copy_src_B[None], base_L1 + copy_dst_B[None]
    kp = state.k_pages.at[:, dst].set(state.k_pages[:, src])
    vp = state.v_pages.at[:, dst].set(state.v_pages[:, src])
    put = lambda a, v: a.at[slot_B].set(v, mode="drop")  # noqa: E731
    return state._replace(
        k_pages=kp, v_pages=vp, page_table=put(state.page_table, row_BY),
        lengths=put(state.lengths, length_B), tokens=put(state.tokens, token_B),
        active=put(state.active, jnp.ones_like(slot_B, bool)),
        remaining=put(state.remaining, remaining_B), sample_ids=put(state.sample_ids, sample_B),
        steps=put(state.steps, jnp.zeros_like(slot_B) if steps_B is None else steps_B),
        rope_delta=put(state.rope_delta, jnp.zeros_like(slot_B) if delta_B is None else delta_B))


@functools.partial(jax.jit, donate_argnames=("state",))
def deactivate(state: DecodeState, slot_mask_B):
    return state._replace(active=state.active & ~slot_mask_B,
                          page_table=jnp.where(slot_mask_B[:, None], NULL_PAGE, state.page_table))


def _zero_state(cfg, ecfg) -> DecodeState:
    B, Y = ecfg.max_slots, ecfg.pages_per_slot
    pool = (cfg.n_kv_heads, cfg.n_layers * ecfg.num_pages, ecfg.page_size, cfg.head_dim)
    i32 = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    return DecodeState(jnp.zeros(pool, cfg.dtype), jnp.zeros(pool, cfg.dtype), i32(B, Y), i32(B),
                       i32(B), jnp.zeros(B, bool), i32(B), i32(B), i32(B), i32(B))


# ----------------------------------------------------------------------------- host side
