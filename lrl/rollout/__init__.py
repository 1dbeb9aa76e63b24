"""lrl.rollout: the paged-KV rollout engine (prefill / insert / generate / free), sampling, and
the `generate` driver with continuous batching.

    outs = lrl.rollout.generate(cfg, params, prompts, max_new_tokens=..., num_samples=G,
                                temperature=1.0, eos_ids=..., seed=0)
"""
from lrl.rollout.engine import DecodeState, Engine, EngineConfig, Prefix, StepOutput
from lrl.rollout.generate import STEPS_PER_CALL, engine_config, generate
from lrl.rollout.pages import (NULL_PAGE, OutOfPages, PagePool, kv_bytes_per_token,
                               num_pages_for_memory, num_pages_for_tokens, pages_for)
from lrl.rollout.sampling import SamplingParams, filter_logits, sample, sample_keys

__all__ = ["DecodeState", "Engine", "EngineConfig", "Prefix", "StepOutput", "STEPS_PER_CALL",
           "engine_config", "generate",
           "NULL_PAGE", "OutOfPages", "PagePool", "kv_bytes_per_token", "num_pages_for_memory",
           "num_pages_for_tokens", "pages_for", "SamplingParams", "filter_logits", "sample",
           "sample_keys"]
