"""`generate`: sample completions for a list of prompts, the public entry to the rollout.

    outs = lrl.rollout.generate(cfg, params, prompts, max_new_tokens=256, num_samples=8,
                                temperature=1.0, eos_ids=cfg.eos_token_ids, seed=0)
    tokens, logps = outs[prompt_index][sample_index]

It builds an engine sized for the call (`engine_for`, from `engine_config`'s keywords) and
runs the scheduler (`lrl.rollout.scheduler`: continuous batching, page growth, preemption)
on it. The loop builds its engine once (`engine_config`, `lrl.loop`) and runs
`scheduler.run(engine, params, Request(...))` itself.

Prompts are admitted in order: a prompt is prefilled once, when its first sample gets a slot,
and its samples then take free slots as they appear, all reading the prompt's pages. Sample g
of prompt p draws its tokens with keys derived from (seed, p * num_samples + g, step),
whatever slot it lands in.

Multimodal prompts pass `prompt_embeds` (per prompt [T', D], T' >= T, visual rows spliced
in) and `prompt_positions` (per prompt [3, T] M-RoPE positions); the prefill reads them once
per prompt and its G samples decode at rotary position `index + rope delta`.

P prompts · G samples per prompt · B batch rows: the engine's slots · T query positions ·
D model width.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from lrl.models.config import ModelConfig
from lrl.rollout import scheduler
from lrl.rollout.engine import Engine, EngineConfig, k_splits
from lrl.rollout.pages import num_pages_for_memory, num_pages_for_tokens, pages_for
from lrl.rollout.paged_kernel import kv_heads_per_program
from lrl.rollout.request import Policy, Request, check_prompts
from lrl.rollout.sampling import SamplingParams
from lrl.rollout.steps import whole_prefill_lengths


def _pool_pages(cfg, prompts, max_new, page_size, slots, pool_tokens, pool_fraction, mesh):
    if pool_tokens is not None:
        return num_pages_for_tokens(pool_tokens, page_size)
    if pool_fraction is not None:
        tensor = mesh.shape["tensor"] if mesh is not None else 1
        shards = tensor if cfg.n_kv_heads % tensor == 0 else 1
        return num_pages_for_memory(cfg, page_size, pool_fraction, kv_shards=shards)
    # Default: room for every prompt's pages and `slots` samples at once (a sample owns at
    # most its new tokens' pages plus the copy of its prompt's partial page).
    prompt_pages = sum(pages_for(len(p) - 1, page_size) for p in prompts)
    return prompt_pages + slots * (pages_for(max_new, page_size) + 1) + 1


def engine_config(cfg: ModelConfig, *, max_prompt_len: int, max_new_tokens: int,
                  max_slots: int, num_pages: int, prefill_chunk: Optional[int] = None,
                  prefill_tokens: int = 16384, max_prompts: Optional[int] = None,
                  resumed_prompts: bool = False, whole_prefill: bool = True,
                  narrow_widths: Optional[Sequence[int]] = None, **launch) -> EngineConfig:
    """An engine's configuration from the sizes it must serve: prompts of at most
    `max_prompt_len` tokens with `max_new_tokens` more, `max_slots` decode rows, a pool of
    `num_pages`. A prefill call is [R, C]: C = `prefill_chunk` (None: the longest prompt's
    cached tokens, a power of two from 16 to 4096), R = `prefill_tokens` // C, and no more
    rows than `max_prompts` prompts fill (when given); calls that fill an eighth of R or less
    take R/8 rows; where C is 4x or more the longest prompt (`resumed_prompts`), a few fresh
    prompts go in calls [1, S], S the longest prompt's tokens as a power of two.
    `narrow_widths` (None: a quarter of the slots, a sixteenth, ..., down to 16 rows) are the
    tail's narrower decode calls.
    `resumed_prompts`: a prompt may come back with its sample's tokens so far (partial
    rollouts), up to `max_prompt_len + max_new_tokens - 1` tokens, and C is sized for that: a
    carried sample in one packed row, not chunk after chunk through the paged path
    (re-prefill was 1.4 s of a 5.5 s step in chunks of 256,
    docs/benchmark-history.md, "Eleventh session"). `whole_prefill`: a prompt longer than C goes in one whole-prompt call, of one
    of a few lengths up to `prefill_tokens` (`whole_prefill_lengths`), not chunk after chunk
    of C through the paged path; False: chunks.

    `launch`: the rest of `EngineConfig`'s fields, as they are: page_size, eos_ids,
    sampling, attention_impl, sampling_impl, decode_block_pages, prefill_block_pages (None:
    1,024 tokens' worth), pallas_k_splits (None: `k_splits` from the slots and the longest
    row: a few long rows still fill the GPU, no program streams a whole long row alone),
    pallas_warps / pallas_stages (the Triton kernel's num_warps, num_stages),
    pallas_kv_per_program, layer_unroll, fused_decode (see `EngineConfig`)."""
    page_size = launch.setdefault("page_size", 16)
    launch["eos_ids"] = tuple(int(e) for e in launch.get("eos_ids", ()))
    longest = max_prompt_len + (max_new_tokens - 1 if resumed_prompts else 0)
    # A prompt of n tokens prefills n - 1: a power of two that holds them, 16 at least.
    chunk_for = lambda n: max(16, 1 << max(0, n - 2).bit_length())  # noqa: E731
    if prefill_chunk is None:
        prefill_chunk = min(4096, chunk_for(longest))
    rows = max(1, prefill_tokens // prefill_chunk)
    if max_prompts is not None:
        rows = min(rows, 1 << max(0, max_prompts - 1).bit_length())
    if launch.get("prefill_block_pages") is None:
        launch["prefill_block_pages"] = max(1, 1024 // page_size)
    if not launch.get("pallas_k_splits"):
        launch["pallas_k_splits"] = k_splits(
            max_slots, cfg.n_kv_heads // kv_heads_per_program(
                cfg.n_heads, cfg.n_kv_heads, launch.get("pallas_kv_per_program", 1)),
            row_tokens=max_prompt_len + max_new_tokens - 1)
    # Fresh prompts' own chunk, where C is sized for much longer (resumed) ones.
    short = chunk_for(max_prompt_len)
    return EngineConfig(
        num_pages=num_pages, max_slots=max_slots,
        max_pages_per_slot=pages_for(max_prompt_len + max_new_tokens - 1, page_size),
        prefill_chunk=prefill_chunk, prefill_rows=rows,
        prefill_narrow_rows=rows // 8 if rows >= 8 else 0,
        prefill_short_chunk=short if 4 * short <= prefill_chunk else 0,
        prefill_batch_tokens=rows * prefill_chunk,
        prefill_lengths=(whole_prefill_lengths(prefill_chunk, longest - 1, prefill_tokens)
                         if whole_prefill else ()),
        narrow_widths=tuple(sorted(set(narrow_widths))) if narrow_widths is not None
        else _tail_widths(max_slots), **launch)


def _tail_widths(slots: int, smallest: int = 16) -> tuple[int, ...]:
    """A quarter of the slots, a sixteenth, ..., while at least `smallest` rows: each width is
    one more compiled decode program, used once at most that many slots are live."""
    widths, w = [], slots // 4
    while w >= smallest:
        widths.append(w)
        w //= 4
    return tuple(sorted(widths))


def engine_for(cfg: ModelConfig, request: Request, *, mesh=None,
               max_slots: Optional[int] = None, pool_tokens: Optional[int] = None,
               pool_fraction: Optional[float] = None, **sizes) -> Engine:
    """An engine sized for `request` alone (what `generate` builds without one): `max_slots`
    slots (None: every sample, up to 256), a pool of `pool_tokens` tokens, or
    `pool_fraction` of free device memory, or by default room for every prompt plus
    `max_slots` samples at once, C and R from its prompts; `sizes` are `engine_config`'s
    keywords (page_size, prefill_chunk, prefill_tokens, whole_prefill, narrow_widths and the
    kernels' launch settings). With a `mesh` its pool is split over kv heads on `tensor`."""
    prompts = check_prompts(request.prompts, cfg.vocab_size)
    B = max_slots or min(request.P * request.num_samples, 256)
    ecfg = engine_config(
        cfg, max_prompt_len=max(len(p) for p in prompts),
        max_new_tokens=request.max_new_tokens, max_slots=B,
        num_pages=_pool_pages(cfg, prompts, request.max_new_tokens,
                              sizes.get("page_size", 16), B, pool_tokens, pool_fraction, mesh),
        max_prompts=request.P, eos_ids=request.end_ids, sampling=request.sampling, **sizes)
    return Engine(cfg, ecfg, mesh)


# generate's keywords that go to the request, the scheduler's policy and `scheduler.run`;
# the rest size the engine (`engine_for`).
_REQUEST = {f.name for f in dataclasses.fields(Request)} - {
    "prompts", "max_new_tokens", "num_samples", "seed", "sampling", "eos_ids", "keep_kv"}
_POLICY = {f.name for f in dataclasses.fields(Policy)}
_RUN = {"engine", "decode_params", "prefill_fn"}


def generate(cfg: ModelConfig, params, prompts: Sequence, *, max_new_tokens: int,
             num_samples: int = 1, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_ids: Sequence[int] = (), seed: int = 0, mesh=None,
             stats: Optional[dict] = None, **options):
    """-> [P][G] list of (token ids int32, log-probs float32) per sample: `num_samples`
    completions of each prompt, at most `max_new_tokens` tokens each, sampled at
    `temperature` (0: greedy) within `top_k` / `top_p`, a sample ending at any of `eos_ids`;
    sample g of prompt p draws with keys from (`seed`, p * num_samples + g, step).

    `options`, by name:
    - the request's (`Request`): samples_per_prompt, max_new_per_prompt, max_new_fn,
      prompt_embeds, prompt_positions, stop_fn, stop_below, kept;
    - the scheduler's (`Policy`): steps_per_call, reserve_pages, overlap_admission;
    - `engine`: one built once for many calls (`engine_config`): its compiled programs and
      pool are reused, and it has its own sizes; `decode_params`: the weights already in its
      decode layout; `prefill_fn(engine, params, state, prefixes) -> state` replaces
      `engine.run_prefill` (`scheduler.run`);
    - without an engine, the sizes of the one built for this call (`engine_for`): max_slots,
      pool_tokens, pool_fraction and `engine_config`'s keywords (page_size, prefill_chunk,
      prefill_tokens, whole_prefill, narrow_widths, attention_impl, decode_block_pages, ...).

    `stats`, when a dict, is filled with timings and counts (`lrl.rollout.state.report`:
    prefill_s, decode_s, decode_steps, new_tokens, sampled_tokens, occupancy, peak_pages,
    ...)."""
    request = Request(prompts, max_new_tokens, num_samples, seed,
                      SamplingParams(float(temperature), int(top_k), float(top_p)),
                      eos_ids, **{k: v for k, v in options.items() if k in _REQUEST})
    policy = Policy(**{k: v for k, v in options.items() if k in _POLICY})
    run = {k: v for k, v in options.items() if k in _RUN}
    sizes = {k: v for k, v in options.items() if k not in _REQUEST | _POLICY | _RUN}
    if not request.P:
        return []
    if run.get("engine") is None:
        run["engine"] = engine_for(cfg, request, mesh=mesh, **sizes)
    elif sizes:
        raise ValueError(f"generate: {sorted(sizes)} size an engine built for the call; "
                         f"the engine given has its own (engine_config)")
    return scheduler.run(params=params, request=request, policy=policy, stats=stats,
                         **run).samples
