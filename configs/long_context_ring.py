"""Long-context GRPO: Qwen2.5-7B on 128K-token rows, attention as a ring over 8 GPUs.

A sample's prompt (a long document and a question) is up to ~120K tokens; each packed row
spans the `seq` axis, so every GPU holds T/8 tokens of it and ring attention passes K/V
blocks around (zig-zag layout for causal balance). The same 8 devices shard the parameters
and optimizer state (`model.param_shard_axes="fsdp,seq"`). Rows of
`{"prompt": <document + question>, "answer": ...}` in a local jsonl.

    python -m lrl.main --config=configs/long_context_ring.py --workdir=/runs/q7-longctx \\
        --config.model.hf_path=/models/Qwen2.5-7B-Instruct \\
        --config.tokenizer.path=/models/Qwen2.5-7B-Instruct \\
        --config.data.paths=/data/longqa/train.jsonl --config.data.eval_paths=/data/longqa/test.jsonl

Prompts of at least `rollout.sp_min_tokens` tokens are prefilled sequence-parallel too: each
is split over the same 8 `seq` devices (ring attention) and its K/V written into the engine's
pages; shorter ones take the engine's own prefill.

Small variant for CPU (8 virtual devices): a tiny random model on the synthetic key-value
retrieval task, ring attention over seq=2, the longer prompts prefilled sequence-parallel:

    python -m lrl.main --config=configs/long_context_ring.py:runlocal --workdir=/tmp/lrl-ring
"""
from lrl import config_util


def get_config(arg: str | None = None):
    a = config_util.parse_arg(arg, runlocal=False)
    c = config_util.load_sibling(__file__, "default.py")
    c.model.update(hf_path="", dtype="bfloat16", param_dtype="float32", attention="ring",
                   remat="save_attn",  # keeps each layer's ring output: no second ring
                   # fp32 masters, Adam moments and gradients are 16 bytes a parameter,
                   # 122 GB for 7B: sharded over the 8 seq devices they are 15 GB each
                   param_shard_axes="fsdp,seq")
    c.tokenizer.path = ""
    c.mesh.update(data=1, fsdp=1, seq=8, tensor=1)   # one 8-GPU node: the row spans all 8
    c.data.update(source="jsonl", paths="", eval_paths="", prompt_field="prompt",
                  answer_field="answer", max_prompt_len=122880, system_prompt="")
    c.sft.steps = 0
    c.rl.update(steps=200, prompts_per_step=8, group_size=8, max_new_tokens=8192,
                temperature=1.0, epochs=1, minibatches=1, row_len=131072,
                max_tokens_per_micro=131072,   # one 128K row over the 8 seq devices
                dynamic_sampling=True, overlong="mask",
                # one long row a step: fewer, larger log-prob chunks re-read the fp32
                # unembedding gradient less often (60.2% MFU at 32K with 8192:
                # docs/benchmark-history.md, "Larger log-prob chunks")
                logprob_chunk=8192,
                # a group's ~120K-token prompt once per row, not 8 times: the update's
                # FLOPs fall ~7x at 128K (BENCHMARKS.md, "The shared-prompt update"); exact
                shared_prompt="auto")
    c.rl.loss.update(clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    c.optim.update(lr=1e-6, warmup_steps=5, weight_decay=0.0, b2=0.999, clip_norm=1.0)
    c.reward.update(spec="exact:1.0", num_workers=8, timeout_s=10.0)
    c.rollout.update(page_size=64, max_slots=64, pool_tokens=0, prefill_tokens=16384,
                     sp_min_tokens=8192)   # prompts this long prefill over the 8 seq devices
    c.eval.update(every=20, num_prompts=64, k=4, temperature=0.6)
    c.checkpoint.update(every_steps=5, every_minutes=30.0, keep=3)
    if a.runlocal:
        c.model.update(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                       mlp_dim=64, dtype="float32", remat="none")
        c.mesh.update(data=1, fsdp=-1, seq=2, tensor=1)
        c.tokenizer.update(path="", vocab_size=320)
        c.data.update(source="synthetic", task="kv_retrieval", max_prompt_len=248,
                      eval_size=4)
        c.data.task_kwargs.kv_retrieval.update(num_pairs=8, min_pairs=2)
        # A random policy never ends within 8 tokens: masking overlong samples would train
        # on nothing, so this smoke run keeps them.
        c.rl.update(steps=2, prompts_per_step=4, group_size=2, max_new_tokens=8, row_len=256,
                    max_tokens_per_micro=512, dynamic_sampling=False, overlong="none",
                    logprob_chunk=256)
        c.reward.update(spec="synthetic:1.0", num_workers=0)
        c.rollout.update(page_size=16, max_slots=8, sp_min_tokens=48, prefill_tokens=1024)
        c.eval.update(every=2, num_prompts=4, k=2, temperature=1.0)
        c.checkpoint.update(every_steps=1, every_minutes=0.0, keep=2)
        c.metrics.tensorboard = False
    return c
