"""The experiment's options as typed, frozen dataclasses, built and checked once from the
(locked) ml_collections config at start-up. Below the loop nothing reads a ConfigDict: the
loop passes these objects down.

Every field is checked as it is read, and an error names the config key (`rl.minibatches`,
not `minibatches`) and says what it must be; cross-field rules and the files a run reads
(data, tokenizer, model directory) are checked here too, before any compile or training.

    opts = options.from_config(config)
    opts.rl.group_size, opts.rl.loss.clip_high, opts.rollout.page_size, ...

One schema for every job and task: a text config (configs/default.py) has every section but
`video`; a video config (configs/video_synthetic.py) builds on it, sets `task="video"` and adds
the `video` section.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import typing
from typing import Mapping, Optional

JOBS = ("grpo", "sft")
TASKS = ("text", "video")
DTYPES = ("float32", "bfloat16", "float16")
SOURCES = {"text": ("synthetic", "jsonl", "parquet"), "video": ("synthetic", "jsonl")}
TEXT_TASKS = ("arithmetic", "kv_retrieval", "tool_lookup")
VIDEO_TASKS = ("direction", "count")
OVERLONG = ("none", "mask", "penalty")
TURN_REWARDS = ("sum", "discount")   # lrl.trajectories.trajectory_reward
TOKEN_ESTIMATORS = ("gae",)   # token-level estimators that read a critic's values (PPO)
SHARED_PROMPT = ("off", "on", "auto")   # lrl.data.shared_prompt.MODES (no jax imported here)


def _opt(*, ge=None, gt=None, lt=None, le=None, choices=None, default=dataclasses.MISSING):
    """A field read from the config, with the bounds or choices it must respect (`default`:
    what code that builds the options by hand gets when it leaves the field out)."""
    return dataclasses.field(default=default,
                             metadata=dict(ge=ge, gt=gt, lt=lt, le=le, choices=choices))


def _check_value(key: str, value, meta: Mapping) -> None:
    bounds = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("lt", lambda v, b: v < b, "<"), ("le", lambda v, b: v <= b, "<="))
    for name, ok, sign in bounds:
        b = meta.get(name)
        if b is not None and not ok(value, b):
            raise ValueError(f"{key}={value!r}: must be {sign} {b}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{key}={value!r}; choose one of {tuple(choices)}")


def _coerce(key: str, value, kind):
    """The config value as the field's type; bools are not numbers here."""
    origin = typing.get_origin(kind)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}={value!r}: expected a number")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}={value!r}: expected an integer")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: expected True or False")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}={value!r}: expected a string")
        return value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{key}={value!r}: expected a tuple")
        return tuple(value)
    if kind is dict or origin is dict:
        return _plain(value)
    return value


def _plain(x):
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    return x


_RENAMED = {
    "rl.micro_batches": "micro-batches are now cut by tokens, not counted: set "
                        "rl.max_tokens_per_micro (0 = from device memory) instead",
}


def _read(cls, section, prefix: str, **nested):
    """`cls` from a config section: every field present, no key unknown, each checked."""
    if section is None:
        raise ValueError(f"config has no {prefix!r} section")
    given = dict(section.items())
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(given) - set(names))
    missing = sorted(set(names) - set(given) - set(nested))
    renamed = {k: _RENAMED[f"{prefix}.{k}"] for k in unknown if f"{prefix}.{k}" in _RENAMED}
    if renamed:
        raise ValueError("; ".join(f"{prefix}.{k}: {why}" for k, why in renamed.items()))
    if unknown or missing:
        raise ValueError(f"config section {prefix!r}: unknown keys {unknown} / missing keys "
                         f"{missing}; its keys are {names}")
    values = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if f.name in nested:
            values[f.name] = nested[f.name]
            continue
        v = _coerce(key, given[f.name], hints[f.name])
        _check_value(key, v, f.metadata)
        values[f.name] = v
    return cls(**values)


# ----------------------------------------------------------------------------- sections

@dataclasses.dataclass(frozen=True)
class ModelOptions:
    hf_path: str
    model_type: str = _opt(choices=("llama", "qwen2", "qwen3"))
    d_model: int = _opt(ge=1)
    n_layers: int = _opt(ge=1)
    n_heads: int = _opt(ge=1)
    n_kv_heads: int = _opt(ge=1)
    head_dim: int = _opt(ge=2)
    mlp_dim: int = _opt(ge=1)
    vocab_size: int = _opt(ge=0)         # 0: the tokenizer's
    rope_theta: float = _opt(gt=0)
    tie_embeddings: bool = _opt()
    param_dtype: str = _opt(choices=DTYPES)
    dtype: str = _opt(choices=DTYPES)
    attention: str = _opt(choices=("dense", "ring", "ulysses"))
    attention_impl: str = _opt(choices=("", "xla", "cudnn"))
    remat: str = _opt(choices=("none", "full", "dots", "dots_no_batch", "dots_attn",
                               "save_attn", "offload_attn"))
    param_shard_axes: str = _opt()

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """param_shard_axes, "fsdp" or "fsdp,seq" -> ("fsdp",) or ("fsdp", "seq")."""
        return tuple(a.strip() for a in self.param_shard_axes.split(",") if a.strip())


@dataclasses.dataclass(frozen=True)
class TokenizerOptions:
    path: str
    vocab_size: int = _opt(ge=2)


@dataclasses.dataclass(frozen=True)
class MeshOptions:
    data: int = _opt(ge=-1)
    fsdp: int = _opt(ge=-1)
    seq: int = _opt(ge=-1)
    tensor: int = _opt(ge=-1)

    def sizes(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DataOptions:
    source: str
    paths: str
    prompt_field: str
    answer_field: str
    messages_field: str
    system_prompt: str
    task: str
    task_kwargs: dict
    size: int = _opt(ge=1)
    eval_size: int = _opt(ge=0)
    eval_paths: str = _opt()
    max_prompt_len: int = _opt(ge=1)


@dataclasses.dataclass(frozen=True)
class SFTOptions:
    steps: int = _opt(ge=0)
    rows: int = _opt(ge=1)
    row_len: int = _opt(ge=2)
    answer_noise: float = _opt(ge=0, le=1)
    lr: float = _opt(gt=0)
    warmup_steps: int = _opt(ge=0)
    paths: str = _opt()
    response_field: str = _opt()


@dataclasses.dataclass(frozen=True)
class LossOptions:
    clip_low: float = _opt(ge=0, lt=1)
    clip_high: float = _opt(ge=0)
    dual_clip: float = _opt(ge=0)        # 0 = off, else > 1 (checked below)
    ratio_level: str = _opt(choices=("token", "sequence"))
    aggregation: str = _opt(choices=("token_mean", "seq_mean_token_mean",
                                     "seq_mean_token_sum_norm"))
    kl_coef: float = _opt(ge=0)
    kl_estimator: str = _opt(choices=("k1", "k2", "k3"))
    entropy_coef: float = _opt()
    tis_cap: float = _opt(ge=0)          # 0 = off
    tis_level: str = _opt(choices=("token", "sequence", "geometric"))
    mask_level: str = _opt(choices=("none", "token", "sequence", "geometric"))
    mask_low: float = _opt(gt=0, le=1)
    mask_high: float = _opt(ge=1)
    staleness_decay: float = _opt(gt=0, le=1)
    max_staleness: int = _opt(ge=-1)     # -1 = no bound
    policy_loss: str = _opt()            # a registered name or "pkg.module:fn" (lrl.rl.registry)

    @property
    def corrects_rollout(self) -> bool:
        """A term of the loss compares the trainer's old log-probs with the sampler's."""
        return self.tis_cap > 0 or self.mask_level != "none"

    @property
    def weighs_staleness(self) -> bool:
        return self.staleness_decay != 1.0 or self.max_staleness >= 0


@dataclasses.dataclass(frozen=True)
class RLOptions:
    steps: int = _opt(ge=0)
    prompts_per_step: int = _opt(ge=1)
    group_size: int = _opt(ge=1)
    max_new_tokens: int = _opt(ge=1)
    temperature: float = _opt(ge=0)
    top_k: int = _opt(ge=0)
    top_p: float = _opt(gt=0, le=1)
    estimator: str = _opt()   # a registered name or "pkg.module:fn" (lrl.rl.registry)
    epochs: int = _opt(ge=1)
    minibatches: int = _opt(ge=1)
    row_len: int = _opt(ge=0)              # 0 = the token budget
    max_tokens_per_micro: int = _opt(ge=0)  # 0 = derived from device memory
    logprob_chunk: int = _opt(ge=1)
    fused_head: bool = _opt()
    recompute_old_logp: bool = _opt()
    dynamic_sampling: bool = _opt()
    max_resample: int = _opt(ge=0)
    overlong: str = _opt(choices=OVERLONG)
    overlong_buffer: int = _opt(ge=0)
    overlong_penalty: float = _opt(ge=0)
    mismatch_fraction: float = _opt(ge=0, le=1)   # 0 = no mismatch metrics
    shared_prompt: str = _opt(choices=SHARED_PROMPT)
    gamma: float = _opt(ge=0, le=1)        # GAE's discount (verl's algorithm.gamma)
    lam: float = _opt(ge=0, le=1)          # GAE's lambda (verl's algorithm.lam)
    kl_in_reward: bool = _opt()            # subtract beta * KL(old || ref) from token rewards
    loss: LossOptions = None
    kl_ctrl: "KLControlOptions" = None

    @property
    def uses_critic(self) -> bool:
        """The estimator reads a critic's values (PPO with GAE)."""
        return self.estimator in TOKEN_ESTIMATORS

    @property
    def needs_ppo_pass(self) -> bool:
        """Advantages are formed after packing, from a forward pass over the packed rows
        (`lrl.ppo`): for a critic's values, or for the KL in the reward."""
        return self.uses_critic or self.kl_in_reward

    @property
    def plain_sampling(self) -> bool:
        """Temperature-1 sampling with no top-k / top-p: the sampler's log-probs are the
        policy's own (up to numerics), so they can serve as the old log-probs."""
        return self.temperature == 1.0 and self.top_k == 0 and self.top_p == 1.0

    @property
    def old_logp(self) -> str:
        """Where a step's old log-probs come from: "sampler" (the rollout's, for plain
        sampling unless `recompute_old_logp`), "trainer" (a forward pass before the updates,
        needed when the policy moves within a step: epochs x minibatches > 1, and by a rollout
        correction, which weighs the trainer's old log-probs against the sampler's: verl's
        decoupled mode), or "none" (one update on-policy data: old = current, without
        gradient)."""
        if self.loss.corrects_rollout:
            return "trainer"
        if self.plain_sampling and not self.recompute_old_logp:
            return "sampler"
        # The KL in the reward reads KL(old || ref) before any update: old log-probs needed.
        return ("trainer" if self.epochs * self.minibatches > 1 or self.kl_in_reward
                else "none")

    @property
    def update_measures_mismatch(self) -> bool:
        """The update's own forward measures the mismatch (on its first minibatch, which runs
        under the weights that sampled); with old log-probs from a trainer forward those give
        it for every micro-batch instead."""
        return self.mismatch_fraction > 0 and self.old_logp != "trainer"

    @property
    def carries_rollout_logp(self) -> bool:
        """The update rows carry the sampler's log-probs (`rollout_logp`): for a rollout
        correction, or for the mismatch metrics unless they are the old log-probs already."""
        return self.loss.corrects_rollout or (self.mismatch_fraction > 0
                                              and self.old_logp != "sampler")


@dataclasses.dataclass(frozen=True)
class KLControlOptions:
    """The KL-in-reward coefficient's controller (verl's algorithm.kl_ctrl)."""
    type: str = _opt(choices=("fixed", "adaptive"))
    coef: float = _opt(ge=0)               # beta (the adaptive controller's start)
    target_kl: float = _opt(gt=0)          # adaptive: the KL it steers to
    horizon: int = _opt(ge=1)              # adaptive: samples over which it moves
    estimator: str = _opt(choices=("k1", "k2", "k3", "low_var_kl"))   # verl's kl_penalty


@dataclasses.dataclass(frozen=True)
class OptimOptions:
    lr: float = _opt(gt=0)
    warmup_steps: int = _opt(ge=0)
    weight_decay: float = _opt(ge=0)
    b1: float = _opt(ge=0, lt=1)
    b2: float = _opt(ge=0, lt=1)
    clip_norm: float = _opt(ge=0)


@dataclasses.dataclass(frozen=True)
class CriticOptions:
    """The critic of PPO (`rl.estimator="gae"`, `lrl.rl.critic`): the policy's decoder with a
    value head, on the same mesh and micro-batches, with its own optimizer."""
    hf_path: str                           # "": the policy's weights (head at zero / small);
                                           # else a HF *ForTokenClassification (1 label) or
                                           # *ForSequenceClassification checkpoint
    head_init_std: float = _opt(ge=0)      # 0: the head starts at zero
    remat: str = _opt(choices=("", "none", "full", "dots", "dots_no_batch", "dots_attn",
                               "save_attn", "offload_attn"))   # "": the policy's
    warmup_steps: int = _opt(ge=0)         # steps that update the critic alone (verl's
                                           # trainer.critic_warmup)
    ppo_epochs: int = _opt(ge=1)           # passes of the critic over each step's minibatches
    cliprange_value: float = _opt(ge=0)    # verl's critic.cliprange_value
    optim: OptimOptions = None


@dataclasses.dataclass(frozen=True)
class RewardModelOptions:
    hf_path: str                           # a *ForSequenceClassification directory; "" = none
    tokenizer_path: str                    # "" = the reward model's directory
    max_len: int = _opt(ge=16)             # T of its packed rows; longer conversations are cut
    batch_rows: int = _opt(ge=1)           # rows of one forward call (one compiled shape)
    dtype: str = _opt(choices=DTYPES)


@dataclasses.dataclass(frozen=True)
class RewardOptions:
    spec: str
    num_workers: int = _opt(ge=0)
    timeout_s: float = _opt(gt=0)
    fail_frac: float = _opt(gt=0, le=1)    # share of a scoring call's items failing: a failed call
    fail_patience: int = _opt(ge=0)        # failed calls in a row that stop the run; 0: never
    model: RewardModelOptions = None       # the `rm` term's reward model (docs/reward-models.md)


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    page_size: int = _opt(ge=1)
    max_slots: int = _opt(ge=1)
    pool_tokens: int = _opt(ge=0)       # 0 = from pool_fraction (or every slot's longest sample)
    pool_fraction: float = _opt(gt=0, le=1)   # of the device memory free after the train state
    prefill_tokens: int = _opt(ge=16)   # tokens of one prefill call (rows x chunk)
    sp_min_tokens: int = _opt(ge=0)     # prompts this long prefill over seq (ring/ulysses)
    narrow_decode: bool = _opt()        # tail decode calls compute the live rows alone
    overlap_admission: bool = _opt()    # keep a decode call in flight while samples wait too
    partial: bool = _opt()              # carry unfinished samples into the next step
    partial_tokens: int = _opt(ge=0)    # decode tokens a step samples at most; 0 = no budget
    partial_tail: float = _opt(ge=-1, lt=1)  # stop once nothing waits and fewer than this
                                             # share of the slots are live; 0 = never;
                                             # -1 = PARTIAL_TAIL with partial, else 0
    partial_seconds: float = _opt(ge=0)  # a step's rollout stops after this long; 0 = no limit
    partial_backlog: float = _opt(ge=0)  # samples waiting behind the full slots as a step
                                         # starts, in steps' worth (rl.prompts_per_step x G)
    max_staleness: int = _opt(ge=0)     # policy versions a carried group may span, then dropped
    partial_keep_kv: bool = _opt()      # with partial: carried samples keep their KV pages in
                                        # the pool (else they are prefilled again)
    # Multi-turn rollouts (lrl.trajectories, lrl.envs): "" = one response per sample
    env: str = _opt(default="")         # a registered environment's name (lrl.envs)
    max_turns: int = _opt(ge=1, default=4)          # model turns a trajectory has at most
    max_turn_tokens: int = _opt(ge=0, default=0)    # tokens one model turn samples at most;
                                                    # 0 = no cap
    tool_timeout_s: float = _opt(gt=0, default=10.0)  # an environment step longer than this
                                                      # ends its trajectory (a timeout)
    turn_reward: str = _opt(choices=TURN_REWARDS, default="sum")  # final + per-turn rewards:
                                        # summed, or discounted by turn_discount per turn
    turn_discount: float = _opt(gt=0, le=1, default=1.0)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    every: int = _opt(ge=0)
    num_prompts: int = _opt(ge=1)
    k: int = _opt(ge=1)
    temperature: float = _opt(ge=0)


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    every_steps: int = _opt(ge=0)
    every_minutes: float = _opt(ge=0)
    keep: int = _opt(ge=1)


@dataclasses.dataclass(frozen=True)
class MetricsOptions:
    tensorboard: bool
    samples_per_step: int = _opt(ge=0)
    wandb_project: str = _opt()         # "" = no Weights & Biases sink (lrl/wandb_sink.py)
    wandb_entity: str = _opt()
    wandb_name: str = _opt()            # "" = the workdir's name
    wandb_mode: str = _opt(choices=("online", "offline"))


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """The one-step-off-policy pipeline (verl's one_step_off_policy trainer): the devices split
    into two meshes, and the rollout of step t+1 runs on the rollout devices while the training
    devices update on step t's batch. Step t then trains on samples drawn with the weights of
    step t-1 (each sample's age is 1; the first step of a run, whose batch nothing sampled
    ahead, samples synchronously, age 0); the sampler's log-probs and the rollout correction
    (`rl.loss.tis_cap`, `mask_level`, `staleness_decay`) apply to them as to any behaviour
    policy's. The new weights go to the rollout devices device to device after each update.

    `rollout_devices`: 0 (the default) runs every step on one mesh of every device, rollout and
    update in turn; n >= 1 gives the last n devices to the rollout and shapes the rest with the
    `mesh.*` sizes (so at least 2 devices; one GPU cannot split). `rollout_tensor`: the
    rollout mesh's tensor-parallel size (0: all n; its other devices hold copies), which must
    divide n and the training device count (the weights are gathered on the training devices
    into the rollout's tensor slices, then copied). Single process, text task, without
    `rollout.partial` (see `_check_pipeline`). A checkpoint saves the batch sampled ahead
    (finished, scored) with the state, so a resume trains exactly what the run would have."""
    rollout_devices: int = _opt(ge=0)   # 0 = off: one mesh, rollout and update in turn
    rollout_tensor: int = _opt(ge=0)    # 0 = all rollout devices on the tensor axis


@dataclasses.dataclass(frozen=True)
class VideoOptions:
    """The video task's own section: frames, the vision tower, and the video-QA fields."""
    frames_in_file: int = _opt(ge=2)    # synthetic videos: frames written per file
    frame: int = _opt(ge=28)            # synthetic videos: square side in pixels
    num_frames: int = _opt(ge=2)        # frames sampled per video (2 per temporal patch)
    min_tokens_per_frame: int = _opt(ge=1)
    max_tokens_per_frame: int = _opt(ge=1)
    cache_dir: str = _opt()
    cache_gib: float = _opt(ge=0)       # device memory the in-memory embedding cache may hold
    frame_axes: str = _opt()
    mrope_section: tuple = _opt()
    vision_depth: int = _opt(ge=1)
    vision_width: int = _opt(ge=1)
    vision_heads: int = _opt(ge=1)
    vision_mlp_dim: int = _opt(ge=1)
    video_field: str = _opt()
    choices_field: str = _opt()
    video_root: str = _opt()
    instruction: str = _opt()
    choice_instruction: str = _opt()


@dataclasses.dataclass(frozen=True)
class Options:
    job: str
    task: str
    seed: int
    model: ModelOptions
    tokenizer: TokenizerOptions
    mesh: MeshOptions
    distributed: dict
    data: DataOptions
    sft: SFTOptions
    rl: RLOptions
    optim: OptimOptions
    reward: RewardOptions
    rollout: RolloutOptions
    eval: EvalOptions
    checkpoint: CheckpointOptions
    metrics: MetricsOptions
    pipeline: PipelineOptions
    critic: CriticOptions = None
    video: Optional[VideoOptions] = None
    compile_cache: str = "auto"   # compiled programs and budgets kept for the next start

    @property
    def rl_steps(self) -> int:
        return self.rl.steps if self.job == "grpo" else 0


_SECTIONS = dict(model=ModelOptions, tokenizer=TokenizerOptions, mesh=MeshOptions,
                 data=DataOptions, sft=SFTOptions, optim=OptimOptions,
                 rollout=RolloutOptions, eval=EvalOptions, checkpoint=CheckpointOptions,
                 metrics=MetricsOptions, pipeline=PipelineOptions)


def from_config(config, check_files: bool = True) -> Options:
    """Typed options from a config; raises ValueError (FileNotFoundError for files) naming the
    key of the first value that would only break later."""
    top = dict(config.items())
    known = set(_SECTIONS) | {"job", "task", "seed", "distributed", "rl", "reward", "video",
                              "compile_cache", "critic"}
    unknown = sorted(set(top) - known)
    if unknown:
        raise ValueError(f"config: unknown top-level keys {unknown}; the keys are "
                         f"{sorted(known)}")
    job, task = top.get("job"), top.get("task", "text")
    if job == "grpo_video":
        raise ValueError("job='grpo_video' is now job='grpo' with task='video' (see "
                         "configs/video_synthetic.py)")
    _check_value("job", job, {"choices": JOBS})
    _check_value("task", task, {"choices": TASKS})
    sections = {name: _read(cls, top.get(name), name) for name, cls in _SECTIONS.items()}
    rl = top.get("rl")
    loss = _read(LossOptions, rl.get("loss") if rl is not None else None, "rl.loss")
    kl_ctrl = _read(KLControlOptions, rl.get("kl_ctrl") if rl is not None else None,
                    "rl.kl_ctrl")
    sections["rl"] = _read(RLOptions, rl, "rl", loss=loss, kl_ctrl=kl_ctrl)
    critic = top.get("critic")
    sections["critic"] = _read(CriticOptions, critic, "critic", optim=_read(
        OptimOptions, critic.get("optim") if critic is not None else None, "critic.optim"))
    reward = top.get("reward")
    rm = _read(RewardModelOptions, reward.get("model") if reward is not None else None,
               "reward.model")
    sections["reward"] = _read(RewardOptions, reward, "reward", model=rm)
    video = top.get("video")
    if task == "video":
        sections["video"] = _read(VideoOptions, video, "video")
    elif video is not None:
        raise ValueError("config has a 'video' section but task='text'; set task='video'")
    from lrl import distributed   # the distributed section keeps its own defaults and checks
    sections["rollout"] = _resolve_tail(sections["rollout"])
    opts = Options(job=job, task=task, seed=_coerce("seed", top["seed"], int),
                   distributed=distributed.settings(top.get("distributed", {})),
                   # a config from before the key (a checkpoint's) keeps the cache on
                   compile_cache=_coerce("compile_cache", top.get("compile_cache", "auto"),
                                         str),
                   **sections)
    _check_across(opts)
    if check_files:
        check_files_exist(opts)
    return opts


def _check_reward_model(o: Options) -> None:
    """An `rm` term in reward.spec needs reward.model.hf_path, and a reward model needs the
    term (and text prompts: it re-renders their chat messages)."""
    names = [p.partition(":")[0].strip() for p in o.reward.spec.split(",")]
    path = o.reward.model.hf_path
    if "rm" in names and not path:
        raise ValueError(f"reward.spec={o.reward.spec!r} has an 'rm' term but "
                         "reward.model.hf_path is empty: point it at a *ForSequenceClassification "
                         "checkpoint")
    if path and "rm" not in names:
        raise ValueError(f"reward.model.hf_path={path!r} is set but reward.spec="
                         f"{o.reward.spec!r} has no 'rm' term to weigh it (e.g. "
                         "'math:0.8,rm:0.2')")
    if path and o.task != "text":
        raise ValueError(f"reward.model.hf_path is set with task={o.task!r}: a reward model "
                         "scores text conversations only")


def _check_across(o: Options) -> None:
    """Rules that tie fields together."""
    from lrl.models.config import check_param_shard_axes
    _check_reward_model(o)
    check_param_shard_axes(o.model.shard_axes, "model.param_shard_axes",
                           o.model.param_shard_axes)
    _check_value("data.source", o.data.source, {"choices": SOURCES[o.task]})
    from lrl.rl import registry   # estimator and policy loss: registered or importable, fitting
    # The run trains a critic for the token-level estimators lrl.ppo builds (gae); another
    # registered one that needs a critic is refused there, naming rl.estimator.
    registry.check(o.rl.estimator, o.rl.loss.policy_loss, critic=o.rl.uses_critic)
    if o.job == "sft":
        if o.task != "text":
            raise ValueError(f"job='sft' runs on the text task only, not task={o.task!r}")
        if o.sft.steps < 1:
            raise ValueError("job='sft' needs sft.steps >= 1")
    if o.task == "video" and o.sft.steps:
        raise ValueError(f"sft.steps={o.sft.steps}: the video task has no SFT warm start; "
                         "set sft.steps=0")
    if o.job == "grpo" and o.rl.group_size < 2:
        raise ValueError(f"rl.group_size={o.rl.group_size}: GRPO needs at least 2 samples "
                         "per prompt")
    if o.data.source != "synthetic" and not o.data.paths:
        raise ValueError(f"data.source={o.data.source!r} needs data.paths")
    if o.data.source == "synthetic":
        tasks = TEXT_TASKS if o.task == "text" else VIDEO_TASKS
        _check_value("data.task", o.data.task, {"choices": tasks})
        if o.task == "text" and o.data.task not in o.data.task_kwargs:
            raise ValueError(f"data.task={o.data.task!r} has no entry in data.task_kwargs "
                             f"(entries: {sorted(o.data.task_kwargs)})")
    if o.task == "text" and o.sft.steps and o.data.source != "synthetic" and not o.sft.paths:
        raise ValueError("sft.steps > 0 needs prompt/response records in sft.paths unless "
                         "data.source='synthetic' (or set sft.steps=0)")
    if o.rl.overlong == "penalty" and not 1 <= o.rl.overlong_buffer <= o.rl.max_new_tokens:
        raise ValueError(f"rl.overlong_buffer={o.rl.overlong_buffer}: the penalty ramps over "
                         f"1 to rl.max_new_tokens={o.rl.max_new_tokens} tokens")
    _check_budget(o)
    _check_partial(o)
    _check_env(o)
    if o.metrics.wandb_project:   # before any compile: the sink starts with the run
        from lrl import wandb_sink
        wandb_sink.require(o.metrics.wandb_project)
    if o.rl.loss.dual_clip and o.rl.loss.dual_clip <= 1.0:
        raise ValueError(f"rl.loss.dual_clip={o.rl.loss.dual_clip}: must be 0 (off) or > 1 "
                         "(verl uses 3)")
    if o.rl.loss.tis_level != "token" and not o.rl.loss.tis_cap:
        raise ValueError(f"rl.loss.tis_level={o.rl.loss.tis_level!r} weighs by a capped ratio: "
                         "set rl.loss.tis_cap > 0 (verl uses 2)")
    if o.rl.loss.aggregation == "seq_mean_token_sum_norm" and o.rl.max_new_tokens < 1:
        raise ValueError("rl.loss.aggregation='seq_mean_token_sum_norm' needs "
                         "rl.max_new_tokens >= 1")
    if o.video is not None:
        v = o.video
        if v.min_tokens_per_frame > v.max_tokens_per_frame:
            raise ValueError(f"video.min_tokens_per_frame={v.min_tokens_per_frame} > "
                             f"video.max_tokens_per_frame={v.max_tokens_per_frame}")
    _check_pipeline(o)
    _check_ppo(o)


def _check_ppo(o: Options) -> None:
    """What the critic and the KL in the reward need."""
    rl, c = o.rl, o.critic
    if not rl.uses_critic:
        for name, v, off in (("warmup_steps", c.warmup_steps, 0), ("hf_path", c.hf_path, "")):
            if v != off:
                raise ValueError(f"critic.{name}={v!r} configures the critic, which only "
                                 f"rl.estimator in {TOKEN_ESTIMATORS} trains (rl.estimator="
                                 f"{rl.estimator!r}); set rl.estimator='gae' or leave it "
                                 f"{off!r}")
        return
    if o.pipeline.rollout_devices:
        raise ValueError(f"rl.estimator={rl.estimator!r} (a critic) with "
                         f"pipeline.rollout_devices={o.pipeline.rollout_devices} is not "
                         "built: use an outcome estimator (grpo, rloo, ...) with the pipeline")
    if o.task != "text":
        raise ValueError(f"rl.estimator={rl.estimator!r} (a critic) runs on the text task "
                         f"only, not task={o.task!r}")
    if rl.loss.ratio_level != "token":
        raise ValueError(f"rl.estimator={rl.estimator!r} gives each token its own advantage: "
                         "rl.loss.ratio_level must be 'token', not "
                         f"{rl.loss.ratio_level!r}")


# The tail share `rollout.partial=True` stops at unless told (`rollout.partial_tail=-1`):
# measured on one H200 (Qwen2.5-1.5B shapes, 64 prompts x 8, 8K new tokens) a step took 8.5 s
# synchronous, 9.1 s with partial rollouts stopping on finished groups alone (the last group
# finishes in the tail: nothing was cut), and 5.4 s at 0.5 (slot occupancy 27% -> 86%).
PARTIAL_TAIL = 0.5


def _resolve_tail(ro: RolloutOptions) -> RolloutOptions:
    """`rollout.partial_tail=-1` (the default): PARTIAL_TAIL with partial rollouts, else 0."""
    if ro.partial_tail >= 0:
        return ro
    if ro.partial_tail != -1:
        raise ValueError(f"rollout.partial_tail={ro.partial_tail}: a share of the slots in "
                         "[0, 1), or -1 for the default")
    return dataclasses.replace(ro, partial_tail=PARTIAL_TAIL if ro.partial else 0.0)


def _check_partial(o: Options) -> None:
    """What partial rollouts (`rollout.partial`) cannot run with: the video task. (With
    `rl.dynamic_sampling` a partial step drops the complete groups whose rewards are all
    equal and rolls on for informative ones; reinforce_pp whitens over the samples a step
    trains, however many: `lrl.collect_partial.partial_rollout`, `lrl.grpo.advantages`.)"""
    ro = o.rollout
    if not ro.partial:
        for name in ("partial_tokens", "partial_tail", "partial_seconds"):
            if getattr(ro, name):
                raise ValueError(f"rollout.{name}={getattr(ro, name)} stops a partial rollout: "
                                 "set rollout.partial=True, or leave it 0")
        return
    if o.task != "text":
        raise ValueError(f"rollout.partial=True runs on the text task only, not task={o.task!r}"
                         ": a carried sample is prefilled again from token ids, and a video "
                         "prompt's embeddings are not kept across steps")


def _check_env(o: Options) -> None:
    """What multi-turn rollouts (`rollout.env`) do not run with yet: the video task, PPO's
    token-level advantages (observation tokens would need values and rewards placed), the
    one-step-off pipeline, partial rollouts and a reward model (the driver's reward is the
    trajectory's)."""
    ro = o.rollout
    if not ro.env:
        return
    from lrl.envs.base import get
    get(ro.env, "rollout.env")   # a registered name or "pkg.module:Factory"
    if o.task != "text":
        raise ValueError(f"rollout.env={ro.env!r} runs on the text task only, not task={o.task!r}")
    for bad, why in ((o.rl.uses_critic, f"rl.estimator={o.rl.estimator!r} (PPO's GAE)"),
                     (o.pipeline.rollout_devices, "pipeline.rollout_devices > 0"),
                     (ro.partial, "rollout.partial=True"),
                     (o.reward.model.hf_path, "reward.model.hf_path")):
        if bad:
            raise ValueError(f"rollout.env={ro.env!r} is not built with {why}: multi-turn "
                             "rollouts train GRPO-family estimators on synchronous steps")
    if ro.max_turn_tokens > o.rl.max_new_tokens:
        raise ValueError(f"rollout.max_turn_tokens={ro.max_turn_tokens} > rl.max_new_tokens="
                         f"{o.rl.max_new_tokens} (the whole trajectory's cap)")


def longest_sample(o: Options) -> Optional[int]:
    """The most tokens one update sample can have (prompt + completion), when the options
    bound it: text prompts are cut at data.max_prompt_len; a video prompt's length is known
    only once its video is decoded (a prompt that does not fit rl.row_len is skipped)."""
    if o.task == "text":
        return o.data.max_prompt_len + o.rl.max_new_tokens
    return None


def longest_prompt(o: Options) -> int:
    """The most tokens a prompt can have: text prompts are cut at data.max_prompt_len; a
    video prompt must leave room in a packed row for its completion."""
    if o.task == "text":
        return o.data.max_prompt_len
    return max(1, o.rl.row_len - o.rl.max_new_tokens)


def _check_budget(o: Options) -> None:
    """A sample must fit one packed row, and a row one micro-batch, before any compile."""
    rl = o.rl
    if rl.row_len == 1:
        raise ValueError("rl.row_len=1: a packed row needs at least 2 tokens (or 0: the budget)")
    if o.task == "video" and rl.row_len == 0:
        raise ValueError("rl.row_len=0: the video task needs a row length (its prompts' "
                         "lengths are known only once the videos are decoded)")
    if rl.max_tokens_per_micro and rl.row_len > rl.max_tokens_per_micro:
        raise ValueError(f"rl.row_len={rl.row_len} > rl.max_tokens_per_micro="
                         f"{rl.max_tokens_per_micro}: a micro-batch holds at least one row")
    longest = longest_sample(o)
    row = rl.row_len or rl.max_tokens_per_micro
    if o.job == "grpo" and longest is not None and row and row < longest:
        key = "rl.row_len" if rl.row_len else "rl.max_tokens_per_micro"
        raise ValueError(f"{key}={row}: a sample can have {longest} tokens "
                         f"(data.max_prompt_len={o.data.max_prompt_len} + rl.max_new_tokens="
                         f"{rl.max_new_tokens}) and must fit one packed row; raise {key} or "
                         "lower those")


def _check_pipeline(o: Options) -> None:
    """What the one-step-off pipeline (`pipeline.*`) cannot run with; the device counts are
    checked where the meshes are built (`lrl.mesh.build_meshes`), still before any
    compile."""
    p = o.pipeline
    if not p.rollout_devices:
        if p.rollout_tensor:
            raise ValueError(f"pipeline.rollout_tensor={p.rollout_tensor} shapes the rollout "
                             "mesh of the pipeline: set pipeline.rollout_devices, or leave it 0")
        return
    if p.rollout_tensor and p.rollout_devices % p.rollout_tensor:
        raise ValueError(f"pipeline.rollout_tensor={p.rollout_tensor} does not divide "
                         f"pipeline.rollout_devices={p.rollout_devices}")
    if o.job != "grpo":
        raise ValueError(f"pipeline.rollout_devices={p.rollout_devices} pipelines GRPO's "
                         f"rollout; job={o.job!r} has none: leave it 0")
    if o.task != "text":
        raise ValueError(f"pipeline.rollout_devices={p.rollout_devices} runs on the text task "
                         f"only, not task={o.task!r}: a video prompt's embeddings are made by "
                         "the vision tower on the training devices")
    if o.rollout.partial:
        raise ValueError(f"pipeline.rollout_devices={p.rollout_devices} with "
                         "rollout.partial=True is not built: partial rollouts carry unfinished "
                         "samples (and their KV pages) into the next step under the newest "
                         "weights, the pipeline samples a whole step ahead on one step's "
                         "weights; turn one off")
    if o.distributed["enabled"]:
        raise ValueError(f"pipeline.rollout_devices={p.rollout_devices} runs in one process "
                         "only (the weights are copied between the process's own devices); "
                         "set distributed.enabled=False or leave it 0")


def _expand(key: str, paths: str) -> None:
    for part in (p.strip() for p in paths.split(",") if p.strip()):
        if not glob.glob(part):
            raise FileNotFoundError(f"{key}: no file matches {part!r}")


def check_files_exist(o: Options) -> None:
    """Every file and directory the run will read, checked now rather than when first read
    (an eval set is first read after the whole SFT phase)."""
    if o.data.source != "synthetic":
        _expand("data.paths", o.data.paths)
        if o.data.eval_paths:
            _expand("data.eval_paths", o.data.eval_paths)
    if o.task == "text" and o.sft.steps and o.sft.paths:
        _expand("sft.paths", o.sft.paths)
    for key, path in (("model.hf_path", o.model.hf_path), ("tokenizer.path", o.tokenizer.path),
                      ("reward.model.hf_path", o.reward.model.hf_path),
                      ("reward.model.tokenizer_path", o.reward.model.tokenizer_path),
                      ("critic.hf_path", o.critic.hf_path)):
        if path and not os.path.isdir(path):
            raise FileNotFoundError(f"{key}={path!r}: no such directory")
    if o.video is not None and o.video.video_root and not os.path.isdir(o.video.video_root):
        raise FileNotFoundError(f"video.video_root={o.video.video_root!r}: no such directory")
    if o.reward.model.hf_path:   # a classifier with one label, not any model directory
        from lrl.rewards.model import check
        check(o.reward.model)


def as_dict(config) -> dict:
    """The config as plain data (what a checkpoint stores)."""
    return _plain(config)

