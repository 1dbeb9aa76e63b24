"""GRPO on a local video-QA dataset with Qwen2.5-VL-7B from a local HF checkpoint.

Each jsonl row names a local video file, a question and its answer, and optionally a list of
choices (multiple choice):

    {"video": "clips/0001.mp4", "question": "What does the person pick up?",
     "choices": ["a cup", "a book", "a phone", "a key"], "answer": "B"}

Field names are configurable (`video.video_field`, `data.prompt_field`, `data.answer_field`,
`video.choices_field`). With choices, the question lists them as "A. ...", "B. ..." and the
answer (a letter, or the option's text) is scored by the `choice` reward; for open answers set
`--config.reward.spec=math:1.0` (math-verify on the last \\boxed{}) or `exact:1.0`.
Relative video paths are read against `video.video_root`, else the jsonl's directory. Rows
that are malformed are reported by file and line, rows whose video is missing by file, line
and path, videos that do not decode by path; all are skipped. The tokenizer is the model's
own (`tokenizer.path` overrides it).

    python -m lrl.main --config=configs/video_qa.py --workdir=/runs/video-qa \\
        --config.model.hf_path=/models/Qwen2.5-VL-7B-Instruct \\
        --config.data.paths=/data/video_qa/train.jsonl \\
        --config.data.eval_paths=/data/video_qa/test.jsonl

On 8 GPUs the default mesh is fsdp=2 x seq=4 with ring attention: every packed row of the
update and every prompt of the rollout prefill is split over the 4 seq shards (Long-RL's
MR-SP stage 2), the vision tower splits each video's frames over all 8 devices, and the
text parameters and optimizer state are sharded over all 8 (fsdp x seq). The update's rows
hold each group's prompt once, before its 8 answers (`rl.shared_prompt="auto"`).

Small variant (a tiny random policy, a tokenizer trained on the jsonl's text; CPU):

    python -m lrl.main --config=configs/video_qa.py:runlocal --workdir=/tmp/video-qa-smoke \\
        --config.data.paths=/data/video_qa/tiny.jsonl
"""
from lrl import config_util


def get_config(arg: str | None = None):
    a = config_util.parse_arg(arg, runlocal=False)
    c = config_util.load_sibling(__file__, "video_synthetic.py")
    c.data.update(source="jsonl",
                  paths="",                    # comma-separated jsonl files or globs
                  eval_paths="",               # held-out jsonl ("" = no evaluation)
                  prompt_field="question", answer_field="answer", system_prompt="")
    c.video.update(num_frames=64, min_tokens_per_frame=64, max_tokens_per_frame=256,
                   cache_dir="", frame_axes="",
                   video_field="video",        # a local video path (absolute, or relative:
                                               # see video_root)
                   choices_field="choices",    # a list of options; rows without it are open
                   video_root="")              # relative video paths are read against this
                                               # ("" = the jsonl's own directory)
    c.model.update(hf_path="", dtype="bfloat16", param_dtype="float32", attention="ring",
                   attention_impl="", remat="full",
                   param_shard_axes="fsdp,seq")  # 7B's masters and Adam over all 8 devices
    c.tokenizer.path = ""            # "" = the model directory's tokenizer
    c.mesh.update(data=1, fsdp=-1, seq=4, tensor=1)
    # 64 frames -> 32 temporal patches of at most 256 tokens: up to 8192 visual tokens a prompt.
    c.rl.update(steps=200, prompts_per_step=16, group_size=8, max_new_tokens=2048,
                temperature=1.0, estimator="grpo", epochs=1, minibatches=2, row_len=16384,
                max_tokens_per_micro=16384, overlong="penalty", overlong_buffer=512,
                overlong_penalty=1.0,
                # A group's video prompt (thousands of tokens) held once per update row, not
                # G times, where it is longer than the group's mean answer (multiple choice:
                # nearly always): lrl.data.shared_prompt. Exact: the same loss and gradients.
                shared_prompt="auto")
    c.rl.loss.update(clip_low=0.2, clip_high=0.28, aggregation="token_mean", kl_coef=0.0)
    c.optim.update(lr=1e-6, warmup_steps=10, weight_decay=0.0, b1=0.9, b2=0.999, clip_norm=1.0)
    c.reward.update(spec="choice:1.0", num_workers=8, timeout_s=10.0)
    c.rollout.update(page_size=16, max_slots=128, pool_tokens=0, prefill_tokens=16384,
                     sp_min_tokens=1024)
    c.eval.update(every=20, num_prompts=128, k=4, temperature=1.0)
    c.checkpoint.update(every_steps=10, every_minutes=30.0, keep=3)
    if a.runlocal:  # a tiny random policy on CPU; data.paths must still be given
        c.model.update(hf_path="", dtype="float32", attention="dense", remat="none")
        c.mesh.update(fsdp=-1, seq=1)
        c.tokenizer.vocab_size = 320
        c.video.update(num_frames=4, min_tokens_per_frame=4, max_tokens_per_frame=16)
        c.rl.update(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=8, row_len=128,
                    max_tokens_per_micro=512, minibatches=1, overlong="none")
        c.optim.update(lr=1e-3, warmup_steps=1)
        c.reward.update(num_workers=0)
        c.rollout.update(max_slots=16, sp_min_tokens=0, prefill_tokens=1024)
        c.eval.update(every=2, num_prompts=2, k=2)
        c.checkpoint.update(every_steps=1, every_minutes=0.0, keep=2)
    return c
