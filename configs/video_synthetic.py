"""GRPO on the synthetic video task: a tiny random Qwen2.5-VL policy watches short mp4s of
moving coloured shapes and answers "which colour moves left?" / "how many squares?".

Nothing is downloaded: the videos are written into the workdir (PyAV), the tokenizer is trained
locally with Qwen2.5-VL's vision tokens added, the model is initialised at random (or loaded
from `model.hf_path`, a local Qwen2.5-VL directory, with `tokenizer.path` its tokenizer).
Each video is decoded and encoded once per run (its embedding is cached in memory, and on disk
across runs with `video.cache_dir`); the embeddings serve its G rollout samples and the update
forward. Held-out videos (another seed) are evaluated every `eval.every` steps; checkpoints go
to <workdir>/checkpoints and a restarted run resumes from the newest.

    python -m lrl.main --config=configs/video_synthetic.py --workdir=/tmp/lrl-video

Small variant for tests and smoke runs (about a minute on a CPU):

    python -m lrl.main --config=configs/video_synthetic.py:runlocal --workdir=/tmp/lrl-video-smoke

Sequence parallelism (Long-RL's MR-SP stage 2) on 8 devices: each packed row of the update and
each prompt of the rollout prefill split over 4 `seq` shards with ring attention:

    python -m lrl.main --config=configs/video_synthetic.py --workdir=/tmp/lrl-video-sp \
        --config.model.attention=ring --config.mesh.seq=4 --config.mesh.fsdp=2

Any field can be overridden, e.g. `--config.video.num_frames=16`; unknown keys fail with their
name. A random policy rarely answers correctly: this config exercises the pipeline, and
rewards rise only with a pretrained `model.hf_path`.
"""
import ml_collections

from lrl import config_util, schema


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_util.parse_arg(arg, runlocal=False)
    c = config_util.load_sibling(__file__, "default.py")
    c.task = "video"
    c.sft.steps = 0                  # no SFT warm start for the video task

    # --- the policy: Qwen2.5-VL's text decoder (here) + vision tower (video section) ---------
    c.model.update(hf_path="",       # a local Qwen2.5-VL directory; empty: random init
                   model_type="qwen2", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=16, mlp_dim=128, rope_theta=10000.0, tie_embeddings=False,
                   param_dtype="float32", dtype="float32",
                   attention="dense",  # ring / ulysses split each packed row (update) and each
                                       # prompt (rollout prefill) over mesh.seq
                   attention_impl="", remat="none", param_shard_axes="fsdp")
    c.tokenizer.update(path="", vocab_size=320)  # a local tokenizer with the vision tokens, or
                                                 # "" to train one with them added

    # --- prompts: synthetic videos (written once into <workdir>/videos) ----------------------
    c.data.update(source="synthetic",  # synthetic (this task) | jsonl (configs/video_qa.py)
                  task="direction",    # direction | count (lrl.data.video_task)
                  size=64,             # distinct training videos
                  eval_size=16)        # held-out videos (another seed)

    # --- the video task's own section: frames and the vision tower --------------------------
    c.video = schema.config_dict(schema.Video)   # its defaults: lrl/schema.py's Video

    # --- GRPO -------------------------------------------------------------------------------
    c.rl.update(steps=20, prompts_per_step=8, group_size=8, max_new_tokens=16,
                temperature=1.0, top_k=0, top_p=1.0, estimator="grpo", epochs=1,
                minibatches=1, row_len=256, max_tokens_per_micro=1024, logprob_chunk=1024,
                fused_head=True, overlong="none", overlong_buffer=4, overlong_penalty=1.0)
    c.rl.loss.update(clip_low=0.2, clip_high=0.28, dual_clip=0.0, ratio_level="token",
                     aggregation="token_mean", kl_coef=0.0, kl_estimator="k3",
                     entropy_coef=0.0, tis_cap=0.0)
    c.optim.update(lr=1e-3, warmup_steps=2, weight_decay=0.0, b1=0.9, b2=0.99, clip_norm=1.0)
    c.reward.update(spec="video:1.0", num_workers=2, timeout_s=10.0)
    c.rollout.update(page_size=16, max_slots=64, pool_tokens=0, sp_min_tokens=0)

    # --- evaluation on held-out videos, checkpoints, metrics ----------------------------------
    c.eval.update(every=10, num_prompts=16, k=4, temperature=1.0)
    c.checkpoint.update(every_steps=10, every_minutes=0.0, keep=2)
    c.metrics.update(tensorboard=False, samples_per_step=2)

    if a.runlocal:
        c.data.update(size=4, eval_size=2)
        c.rl.update(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=8, row_len=128)
        c.reward.num_workers = 0
        c.rollout.max_slots = 8
        c.eval.update(every=2, num_prompts=2, k=2)
    return c
