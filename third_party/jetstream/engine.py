"""`LrlEngine`: lrl's paged rollout engine (`lrl.rollout.engine.Engine` and the device steps
of `lrl.rollout.steps`) presented as JetStream's `jetstream.engine.engine_api.Engine`.

JetStream's API and lrl's engine differ in one place: JetStream's `prefill` makes a prompt's
KV cache apart from the decode state (its prefill thread runs while the generate thread owns
and donates that state), while lrl's prefill writes straight into the decode state's page
pool. So here:
- `prefill` runs lrl's prefill (`Engine.run_prefill`) into a small pool of the prompt's own
  (`LrlPrefix`: K and V of the prompt's first T - 1 tokens, page 0 its null page). Its size
  is a power of two of tokens, so prefill compiles once per length bucket.
- `insert` frees whatever the slot held, takes pool pages for the prompt, copies its pages
  there (all layers, one jitted scatter), and reserves the slot as lrl's engine does (the
  slot also takes the prompt's partly filled page; pages for `max_new_tokens` are reserved,
  so a slot never runs out mid-reply). JetStream has no `free`: a slot's pages go back when
  the next request is inserted there.
- `generate` is one lrl decode step for every slot. `ResultTokens` holds per slot the token,
  whether the slot was live and sampled it, and how many tokens it has sampled (JetStream's
  detokenizer ends a request when that count passes the request's `max_tokens`, on an end
  token, or on an invalid entry: a slot that stopped at `max_new_tokens` or was never
  filled). One step per call: JetStream checks `max_tokens` once per call, so several steps
  a call would overshoot it.

The prompt's last token is fed by the first decode step (lrl's convention), so every token
of the reply, the first included, comes out of `generate`. Sampling (greedy, temperature,
top-k, top-p) is one setting for the whole server: JetStream 0.2.2's requests carry none.
A sample's keys come from the server's seed and the request's admission number.

Requests that cannot be served (a prompt longer than `max_prefill_length`, an empty one,
ids outside the vocabulary) must not raise here: JetStream kills its process when a driver
thread raises. `prefill` returns an `LrlPrefix` carrying the error, `insert` leaves the slot
idle, and the request ends with no tokens; `server.py` refuses such requests up front with
an error that names the limit (`LrlEngine.request_error`).

T prompt tokens · S slots · K kv heads · L layers · H head dim · P pages of a prompt pool.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lrl.models.config import ModelConfig
from lrl.rollout.engine import DecodeState, Engine, EngineConfig, Prefix
from lrl.rollout.pages import NULL_PAGE, pages_for
from lrl.rollout.sampling import SamplingParams
from third_party.jetstream import compat
from third_party.jetstream.tokenizer import BOS_MARK, HFTokenizer

compat.install()
from jetstream.engine import engine_api, tokenizer_pb2  # noqa: E402

log = logging.getLogger("lrl.serve")

# The lengths JetStream 0.2.2 pads prompts to (`token_utils.pad_tokens`); its padding fails
# for a max_prefill_length that is not one of them.
PREFILL_LENGTHS = tuple(16 << i for i in range(12))   # 16 ... 32768


@struct.dataclass
class LrlPrefix:
    """A prefilled prompt. `error` set: the request cannot be served (no arrays then)."""
    k_pages: Optional[jax.Array]   # [K, L * P, page_size, H], page 0 the null page
    v_pages: Optional[jax.Array]
    tokens: tuple = struct.field(pytree_node=False, default=())
    error: str = struct.field(pytree_node=False, default="")


@functools.partial(jax.jit, static_argnames=("num_layers",), donate_argnames=("state",))
def _copy_prompt_pages(state: DecodeState, k_src, v_src, src_M, dst_M, num_layers: int):
    """Copies pages src_M of a prompt pool into pages dst_M of the decode state's pool, in
    every layer. Padding entries copy the prompt pool's null page onto the pool's."""
    layer_L1 = jnp.arange(num_layers, dtype=jnp.int32)[:, None]
    src = (layer_L1 * (k_src.shape[1] // num_layers) + src_M[None]).reshape(-1)
    dst = (layer_L1 * (state.k_pages.shape[1] // num_layers) + dst_M[None]).reshape(-1)
    return state._replace(k_pages=state.k_pages.at[:, dst].set(k_src[:, src]),
                          v_pages=state.v_pages.at[:, dst].set(v_src[:, src]))


@jax.jit
def _result_data(out_tokens, out_valid, steps_S):
    """[S, 3] int32: the step's token, its validity, the slot's sampled-token count."""
    return jnp.stack([out_tokens[0], out_valid[0].astype(jnp.int32), steps_S], axis=1)


class LrlEngine(engine_api.Engine):
    """One device, one sample per request. `engine_options` go to `EngineConfig` (e.g.
    attention_impl, decode_block_pages, prefill_block_pages); the pool holds every slot's
    longest request, so admission never waits for pages."""

    def __init__(self, cfg: ModelConfig, params, tokenizer: HFTokenizer, *,
                 max_prefill_length: int = 1024, max_new_tokens: int = 512,
                 max_slots: int = 8, page_size: int = 16,
                 sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 **engine_options):
        if max_prefill_length not in PREFILL_LENGTHS:
            raise ValueError(f"max_prefill_length={max_prefill_length}: JetStream pads prompts "
                             f"to one of {PREFILL_LENGTHS}; choose one of them")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self._max_prefill_length = int(max_prefill_length)
        # The longest request: the whole padded prompt (no BOS mark) plus the reply.
        need = pages_for(max_prefill_length + max_new_tokens - 1, page_size)
        self.ecfg = EngineConfig(
            page_size=page_size, max_slots=max_slots, max_pages_per_slot=need,
            # One spare page per slot: `Engine.check_fits` counts a prompt's partial page
            # twice (once for the prompt, once for its copy), though the slot takes it over.
            num_pages=max_slots * (need + 1) + 1,
            prefill_chunk=min(4096, max_prefill_length),
            eos_ids=tuple(tokenizer.eos_ids), sampling=sampling, **engine_options)
        self._engine = Engine(cfg, self.ecfg)
        self.device = jax.local_devices()[0]
        self._params = self._engine.decode_params(params)
        self._rng = jax.random.key(seed)
        self._admitted = 0

    # ---- what the orchestrator asks
    def load_params(self, *args, **kwargs):
        """The weights in lrl's decode layout (`lrl.rollout.weights`), relaid once."""
        return self._params

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """A fresh pool and slots; the host bookkeeping starts over with them."""
        self._engine = Engine(self.cfg, self.ecfg)
        return self._engine.init_decode_state()

    @property
    def max_concurrent_decodes(self) -> int:
        return self.ecfg.max_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return jax.sharding.Mesh(np.array([self.device]).reshape(1, 1, 1, 1),
                                 ("data", "fsdp", "seq", "tensor"))

    @property
    def colocated_cpus(self):
        return jax.local_devices(backend="cpu")

    def get_prefix_destination_sharding(self):
        return jax.sharding.SingleDeviceSharding(self.device)

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(
            path=str(getattr(self.tokenizer.hf, "name_or_path", "") or ""), extra_ids=0)

    def build_tokenizer(self, metadata) -> HFTokenizer:
        return self.tokenizer

    # ---- limits
    def request_error(self, prompt_positions: int, max_tokens: int) -> Optional[str]:
        """Why a request cannot be served, or None. `prompt_positions` counts JetStream's BOS
        position when it adds one."""
        if max_tokens < 1:
            return (f"max_tokens={max_tokens}: ask for at least one token (an unset "
                    f"max_tokens is 0)")
        if max_tokens > self.max_new_tokens:
            return (f"max_tokens={max_tokens} is more than this server generates for one "
                    f"request (max_new_tokens={self.max_new_tokens})")
        if prompt_positions > self._max_prefill_length:
            return (f"the prompt takes {prompt_positions} positions (its tokens, and one for "
                    f"JetStream's BOS), more than this server's max_prefill_length="
                    f"{self._max_prefill_length}")
        return None

    def _prompt(self, padded_tokens, true_length: int):
        """-> (tokens int32, None) or (None, error)."""
        padded = np.asarray(padded_tokens).reshape(-1)
        n = int(true_length)
        if n > padded.size:   # JetStream's padding kept only the last tokens
            return None, (f"the prompt takes {n} positions, more than max_prefill_length="
                          f"{self._max_prefill_length}")
        tokens = padded[:n]
        if tokens.size and tokens[0] == BOS_MARK:
            tokens = tokens[1:]
        if tokens.size == 0:
            return None, "the prompt is empty"
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            return None, (f"the prompt has token ids outside [0, {self.cfg.vocab_size}): "
                          f"min {tokens.min()}, max {tokens.max()}")
        return tokens.astype(np.int32), None

    # ---- prefill / insert / generate
    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int
                ) -> LrlPrefix:
        if existing_prefix is not None:
            raise NotImplementedError("LrlEngine.prefill: continuing an existing prefix is not "
                                      "supported (JetStream 0.2.2's orchestrator never asks)")
        tokens, error = self._prompt(padded_tokens, true_length)
        if error:
            log.error("request refused at prefill: %s", error)
            return LrlPrefix(None, None, (), error)
        cached = tokens.size - 1   # the last token is fed by the first decode step
        if cached == 0:
            return LrlPrefix(None, None, tuple(tokens.tolist()))
        e, c = self.ecfg, self.cfg
        # A power-of-two pool of its own per length bucket: few shapes to compile.
        bucket = max(16, 1 << (cached - 1).bit_length())
        pool_shape = (c.n_kv_heads, c.n_layers * (pages_for(bucket, e.page_size) + 1),
                      e.page_size, c.head_dim)
        with jax.default_device(self.device):
            own = DecodeState(jnp.zeros(pool_shape, c.dtype), jnp.zeros(pool_shape, c.dtype),
                              *[None] * (len(DecodeState._fields) - 2))
        pre = Prefix(tokens, pages=list(range(1, pages_for(cached, e.page_size) + 1)),
                     partial=cached % e.page_size != 0)
        own = self._engine.run_prefill(params, own, [pre])
        return LrlPrefix(own.k_pages, own.v_pages, tuple(tokens.tolist()))

    def insert(self, prefix: LrlPrefix, decode_state: DecodeState, slot: int) -> DecodeState:
        engine = self._engine
        if engine.slot_pages[slot] is not None:
            decode_state = engine.free(decode_state, [slot])
        if prefix.error:   # the slot stays idle: its first result is invalid, ending the request
            return decode_state
        pre = engine.reserve_prefix(np.asarray(prefix.tokens, np.int32))
        if pre.pages:
            width = prefix.k_pages.shape[1] // self.cfg.n_layers - 1
            src = np.full(width, NULL_PAGE, np.int32)
            dst = np.full(width, NULL_PAGE, np.int32)
            src[:len(pre.pages)] = np.arange(1, len(pre.pages) + 1)
            dst[:len(pre.pages)] = pre.pages
            decode_state = _copy_prompt_pages(decode_state, prefix.k_pages, prefix.v_pages,
                                              src, dst, num_layers=self.cfg.n_layers)
        plan = engine.reserve_slot(pre, slot, self._admitted, self.max_new_tokens, last=True)
        decode_state = engine.run_insert(decode_state, [plan])
        engine.release(pre)
        self._admitted += 1
        return decode_state

    def generate(self, params, decode_state: DecodeState):
        state, out = self._engine.generate(params, decode_state, self._rng, num_steps=1)
        return state, engine_api.ResultTokens(
            data=_result_data(out.tokens, out.valid, state.steps),
            tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1)

