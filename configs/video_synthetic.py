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

from lrl import distributed


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "grpo_video"
    c.seed = 0

    # --- the policy: Qwen2.5-VL text decoder + vision tower -------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""             # a local Qwen2.5-VL directory; empty: random init below
    c.model.d_model = 64
    c.model.n_layers = 2
    c.model.n_heads = 4
    c.model.n_kv_heads = 2
    c.model.head_dim = 16
    c.model.mlp_dim = 128
    c.model.rope_theta = 10000.0
    c.model.mrope_section = (2, 3, 3)  # (t, h, w) frequency sections, summing to head_dim / 2
    c.model.vision_depth = 2
    c.model.vision_width = 32
    c.model.vision_heads = 2
    c.model.vision_mlp_dim = 64
    c.model.param_dtype = "float32"
    c.model.dtype = "float32"
    c.model.attention = "dense"      # dense | ring | ulysses: ring / ulysses split each packed
                                     # row (update) and each prompt (rollout prefill) over mesh.seq
    c.model.attention_impl = ""      # "" = cuDNN on GPU, XLA elsewhere; or "xla" / "cudnn"
    c.model.remat = "none"           # none | full | dots | dots_no_batch | save_attn | offload_attn
    c.model.param_shard_axes = "fsdp"  # "fsdp,seq": the seq devices shard the parameters too

    # --- the device mesh: sizes per axis, -1 = all remaining devices (one process) -------------
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, seq=1, tensor=1))
    c.distributed = ml_collections.ConfigDict(dict(distributed.DEFAULTS))  # enabled=False

    # --- tokenizer: a local HF tokenizer dir with the vision tokens, or "" to train one ------
    c.tokenizer = ml_collections.ConfigDict(dict(path="", vocab_size=320))

    # --- videos: the synthetic task and how frames become visual tokens ----------------------
    c.video = ml_collections.ConfigDict()
    c.video.source = "synthetic"     # synthetic (this task) | jsonl (configs/video_qa.py)
    c.video.task = "direction"       # direction | count (lrl.data.video_task)
    c.video.size = 64                # distinct videos (written once into <workdir>/videos)
    c.video.frames_in_file = 8       # frames written per video
    c.video.frame = 112              # square frame side in pixels
    c.video.num_frames = 4           # frames sampled per video (2 per temporal patch)
    c.video.min_tokens_per_frame = 4   # merged 28x28 tokens a frame may resize to
    c.video.max_tokens_per_frame = 16
    c.video.cache_dir = ""           # "" = in-memory embedding cache; a path = on disk too
    c.video.frame_axes = ""          # mesh axes the vision tower splits frames over; "" = all

    # --- GRPO -------------------------------------------------------------------------------
    c.rl = ml_collections.ConfigDict()
    c.rl.steps = 20
    c.rl.prompts_per_step = 8        # P
    c.rl.group_size = 8              # G
    c.rl.max_new_tokens = 16
    c.rl.temperature = 1.0
    c.rl.top_k = 0
    c.rl.top_p = 1.0
    c.rl.estimator = "grpo"
    c.rl.epochs = 1
    c.rl.minibatches = 1
    c.rl.micro_batches = 1
    c.rl.row_len = 256
    c.rl.logprob_chunk = 1024        # positions of every row per step of the log-prob scan
    c.rl.fused_head = True           # loss gradient formed in the lm head's forward pass
    c.rl.overlong = "none"
    c.rl.overlong_buffer = 4
    c.rl.overlong_penalty = 1.0
    c.rl.loss = ml_collections.ConfigDict(dict(
        clip_low=0.2, clip_high=0.28, dual_clip=0.0, ratio_level="token",
        aggregation="token_mean", kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
        tis_cap=0.0))

    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-3, warmup_steps=2, weight_decay=0.0, b1=0.9, b2=0.99, clip_norm=1.0))
    c.reward = ml_collections.ConfigDict(dict(
        spec="video:1.0", num_workers=2, timeout_s=10.0,
        fail_frac=1.0,               # share of a scoring call's items failing that fails the call
        fail_patience=3))            # that many failed calls in a row stop the run; 0: never
    c.rollout = ml_collections.ConfigDict(dict(
        page_size=16, max_slots=64, pool_tokens=0,
        sp_min_tokens=0))            # with ring/ulysses over seq > 1: prompts of at least this
                                     # many tokens are prefilled sequence-parallel

    # --- evaluation on held-out videos (another seed), checkpoints, metrics -----------------
    c.eval = ml_collections.ConfigDict(dict(every=10, num_prompts=16, k=4, temperature=1.0))
    c.checkpoint = ml_collections.ConfigDict(dict(every_steps=10, every_minutes=0.0, keep=2))
    c.metrics = ml_collections.ConfigDict(dict(tensorboard=False, samples_per_step=2))

    if arg == "runlocal":
        c.video.size = 4
        c.rl.steps = 2
        c.rl.prompts_per_step = 2
        c.rl.group_size = 4
        c.rl.max_new_tokens = 8
        c.rl.row_len = 128
        c.reward.num_workers = 0
        c.rollout.max_slots = 8
        c.eval.every = 2
        c.eval.num_prompts = 2
        c.eval.k = 2
    elif arg:
        raise ValueError(f"configs/video_synthetic.py: unknown argument {arg!r}; use "
                         "'runlocal' or none")
    return c
