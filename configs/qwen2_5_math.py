"""GRPO on math with Qwen2.5 (1.5B or 7B) from a local HF checkpoint and a local jsonl dataset.

Rows of `{"problem": ..., "answer": ...}` (e.g. a MATH / DAPO-17k export); the reward is
`\\boxed{}` equivalence via math-verify. 16K tokens per sample for 1.5B, 32K for 7B.

    python -m lrl.main --config=configs/qwen2_5_math.py:1.5b --workdir=/runs/q15-math \\
        --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct \\
        --config.tokenizer.path=/models/Qwen2.5-1.5B-Instruct \\
        --config.data.paths=/data/math/train.jsonl --config.data.eval_paths=/data/math/test.jsonl

Use `:7b` (and the 7B paths) for Qwen2.5-7B-Instruct at 32K.
"""
from lrl import config_util


def get_config(arg: str | None = None):
    arg = config_util.parse_arg(arg, size="1.5b").size
    if arg not in ("1.5b", "7b"):
        raise ValueError(f"configs/qwen2_5_math.py: argument {arg!r}; use '1.5b' or '7b'")
    c = config_util.load_sibling(__file__, "default.py")
    c.model.update(hf_path="", dtype="bfloat16", param_dtype="float32", attention="dense",
                   remat="dots_attn" if arg == "1.5b" else "save_attn")
    c.tokenizer.path = ""                      # the model's own directory
    c.data.update(source="jsonl", paths="", eval_paths="", prompt_field="problem",
                  answer_field="answer", max_prompt_len=1024,
                  system_prompt="Please reason step by step, and put your final answer "
                                "within \\boxed{}.")
    c.sft.steps = 0                            # an instruct model needs no warm start
    total = 16384 if arg == "1.5b" else 32768  # prompt + completion tokens per sample
    c.rl.update(steps=500, prompts_per_step=64 if arg == "1.5b" else 32, group_size=8,
                max_new_tokens=total - 1024, temperature=1.0, estimator="grpo", epochs=1,
                minibatches=4,
                row_len=0,                     # rows of the token budget
                max_tokens_per_micro=0,        # from the device's memory, at start-up
                dynamic_sampling=True, max_resample=2, overlong="penalty",
                overlong_buffer=4096, overlong_penalty=1.0)
    c.rl.loss.update(clip_low=0.2, clip_high=0.28, aggregation="token_mean", kl_coef=0.0)
    c.optim.update(lr=1e-6, warmup_steps=10, weight_decay=0.0, b1=0.9, b2=0.999,
                   clip_norm=1.0)
    c.reward.update(spec="math:1.0", num_workers=16, timeout_s=10.0)
    c.rollout.update(page_size=16, max_slots=256, pool_tokens=0, pool_fraction=0.4,
                     prefill_tokens=16384,
                     # Partial rollouts (docs/partial-rollouts.md): a step stops decoding in
                     # the tail (fewer than an eighth of its samples live: 1.5b, 64 of 256
                     # slots; 7b, 32) and its unfinished samples go on in the
                     # next step, each token trained against the log-prob of the policy that
                     # drew it; a group spanning more than max_staleness versions is dropped
                     # (counted: partial/dropped_stale_groups). 4, not 2: a 15K-token answer
                     # spans several steps, and dropping it biases against long reasoning.
                     partial=True, max_staleness=4)
    c.eval.update(every=20, num_prompts=256, k=4, temperature=0.6)
    c.checkpoint.update(every_steps=10, every_minutes=30.0, keep=3)
    return c
