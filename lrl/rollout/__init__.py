"""lrl.rollout: the paged-KV rollout engine (prefill / insert / generate / free), sampling, the
scheduler (continuous batching over the engine's slots) and `generate`, its public entry.

    outs = lrl.rollout.generate(cfg, params, prompts, max_new_tokens=..., num_samples=G,
                                temperature=1.0, eos_ids=..., seed=0)
    result = lrl.rollout.run(engine, params, lrl.rollout.Request(prompts, max_new_tokens=...))
"""
from lrl.rollout.engine import DecodeState, Engine, EngineConfig, Prefix, StepOutput
from lrl.rollout.generate import engine_config, engine_for, generate
from lrl.rollout.pages import (NULL_PAGE, OutOfPages, PagePool, kv_bytes_per_token,
                               num_pages_for_memory, num_pages_for_tokens, pages_for)
from lrl.rollout.request import STEPS_PER_CALL, Policy, Request, Result
from lrl.rollout.sampling import SamplingParams, filter_logits, sample, sample_keys
from lrl.rollout.scheduler import run

__all__ = ["DecodeState", "Engine", "EngineConfig", "Prefix", "StepOutput", "STEPS_PER_CALL",
           "engine_config", "engine_for", "generate", "Policy", "Request", "Result", "run",
           "NULL_PAGE", "OutOfPages", "PagePool", "kv_bytes_per_token", "num_pages_for_memory",
           "num_pages_for_tokens", "pages_for", "SamplingParams", "filter_logits", "sample",
           "sample_keys"]
