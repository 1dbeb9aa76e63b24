"""The experiment's options: the config read once at start-up into the schema's typed, frozen
sections (`lrl.schema`, where every field's default, type, bound and doc is declared), checked
across fields, with the step policy that follows from them. Below the loop nothing reads a
ConfigDict: the loop passes these objects down.

Every field is checked as it is read (`schema.read`), and an error names the config key
(`rl.minibatches`, not `minibatches`) and says what it must be; the rules that tie fields
together and the files a run reads (data, tokenizer, model directory) are checked here, before
any compile or training.

    opts = options.from_config(config)
    opts.rl.group_size, opts.rl.loss.clip_high, opts.rollout.page_size, opts.rl.old_logp, ...

One schema for every job and task: a text config (configs/default.py) has every section but
`video`; a video config (configs/video_synthetic.py) builds on it, sets `task="video"` and adds
the `video` section.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from typing import Optional

from lrl import schema
from lrl.schema import DTYPES, JOBS, OVERLONG, SHARED_PROMPT, TASKS  # noqa: F401 (re-exported)

SOURCES = {"text": ("synthetic", "jsonl", "parquet"), "video": ("synthetic", "jsonl")}
TEXT_TASKS = ("arithmetic", "kv_retrieval", "tool_lookup")
VIDEO_TASKS = ("direction", "count")
TOKEN_ESTIMATORS = ("gae",)   # token-level estimators that read a critic's values (PPO)

_RENAMED = {
    "rl.micro_batches": "micro-batches are now cut by tokens, not counted: set "
                        "rl.max_tokens_per_micro (0 = from device memory) instead",
}

# ----------------------------------------------------------------------------- the typed sections
# The schema's sections as the run reads them; those with a policy derived from their fields
# carry it here.

TokenizerOptions = schema.Tokenizer
DataOptions = schema.Data
SFTOptions = schema.SFT
KLControlOptions = schema.KLControl
OptimOptions = schema.Optim
CriticOptions = schema.Critic
RewardModelOptions = schema.RewardModel
RewardOptions = schema.Reward
RolloutOptions = schema.Rollout
EvalOptions = schema.Eval
CheckpointOptions = schema.Checkpoint
MetricsOptions = schema.Metrics
PipelineOptions = schema.Pipeline
VideoOptions = schema.Video


class ModelOptions(schema.Model):
    @property
    def shard_axes(self) -> tuple[str, ...]:
        """param_shard_axes, "fsdp" or "fsdp,seq" -> ("fsdp",) or ("fsdp", "seq")."""
        return tuple(a.strip() for a in self.param_shard_axes.split(",") if a.strip())


class MeshOptions(schema.Mesh):
    def sizes(self) -> dict:
        return dataclasses.asdict(self)


class LossOptions(schema.Loss):
    @property
    def corrects_rollout(self) -> bool:
        """A term of the loss compares the trainer's old log-probs with the sampler's."""
        return self.tis_cap > 0 or self.mask_level != "none"

    @property
    def weighs_staleness(self) -> bool:
        return self.staleness_decay != 1.0 or self.max_staleness >= 0


class RLOptions(schema.RL):
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


# What `schema.read` builds for a schema section: its typed subclass above.
_TYPED = {schema.Model: ModelOptions, schema.Mesh: MeshOptions, schema.Loss: LossOptions,
          schema.RL: RLOptions}


@dataclasses.dataclass(frozen=True)
class Options(schema.Config):
    """The whole run's options: the schema's `Config` with typed sections."""
    distributed: dict = None   # lrl.distributed.settings: the section over its defaults

    @property
    def rl_steps(self) -> int:
        return self.rl.steps if self.job == "grpo" else 0


def from_config(config, check_files: bool = True) -> Options:
    """Typed options from a config; raises ValueError (FileNotFoundError for files) naming the
    key of the first value that would only break later."""
    top = dict(config.items())
    known = {f.name: f for f in schema.fields(schema.Config)}
    unknown = sorted(set(top) - set(known))
    if unknown:
        raise ValueError(f"config: unknown top-level keys {unknown}; the keys are "
                         f"{sorted(known)}")
    job, task = top.get("job"), top.get("task", schema.Config.task)
    if job == "grpo_video":
        raise ValueError("job='grpo_video' is now job='grpo' with task='video' (see "
                         "configs/video_synthetic.py)")
    schema.check_value("job", job, known["job"].metadata)
    schema.check_value("task", task, known["task"].metadata)
    sections = {f.name: schema.read(schema.nested(f), top.get(f.name), f.name, _TYPED, _RENAMED)
                for f in schema.fields(schema.Config)
                if schema.nested(f) is not None and f.name not in ("distributed", "video")}
    video = top.get("video")
    if task == "video":
        sections["video"] = schema.read(schema.Video, video, "video")
    elif video is not None:
        raise ValueError("config has a 'video' section but task='text'; set task='video'")
    # `distributed` may leave out fields (its defaults: schema.Distributed) and stays a dict;
    # lrl.distributed imports jax, so only here.
    from lrl import distributed
    sections["rollout"] = _resolve_tail(_resolve_slots(sections["rollout"], sections["rl"]),
                                        sections["rl"])
    opts = Options(job=job, task=task, seed=schema.coerce("seed", top["seed"], int),
                   distributed=distributed.settings(top.get("distributed", {})),
                   # a config from before the key (a checkpoint's) keeps the cache on
                   compile_cache=schema.coerce("compile_cache", top.get(
                       "compile_cache", schema.Config.compile_cache), str),
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
    schema.check_value("data.source", o.data.source, {"choices": SOURCES[o.task]})
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
        schema.check_value("data.task", o.data.task, {"choices": tasks})
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
    if c.optim.offload == "on":
        raise ValueError("critic.optim.offload='on': the critic's optimizer stays on the "
                         "device (only the policy's is offloaded, lrl/rl/offload.py); set "
                         "it 'off' or 'auto'")
    if c.optim.grad_sink == "on":
        raise ValueError("critic.optim.grad_sink='on': the critic's update stacks its layers' "
                         "gradients (only the policy's adds them into the accumulator, "
                         "lrl/models/grad_sink.py); set it 'off' or 'auto'")
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


# The most slots `rollout.max_slots=0` gives. A decode step reads every weight whatever its
# rows, so on a GPU more slots cost little until the step turns compute-bound: at Qwen2.5-1.5B
# shapes on one H100 (64 prompts x 8, partial rollouts) the rollout took 4.7 s a step at 128
# slots and 2.0 s at 512, the trained tokens a second 20.3K and 25.2K (BENCHMARKS.md
# "Start-up"). On 2 CPU cores the embedded default's steps took 5.1 s at 256 against 5.8 s at
# 128 (one job).
AUTO_SLOTS = 512

# `rollout.partial=True` stops in the tail, unless told (`rollout.partial_tail=-1`), once fewer
# than a TAIL_SAMPLES share of the step's samples are live (at most half the slots). Measured on
# one H200 at 128 slots (Qwen2.5-1.5B shapes, 64 prompts x 8, 8K new tokens): a step took 8.5 s
# synchronous, 9.1 s stopping on finished groups alone and 5.4 s at half the slots (64 live, an
# eighth of the samples). A share of the slots alone does not carry over to more slots: at 512
# slots half of them is half the samples, carried into the next step, where a fifth of the
# groups then grew older than rollout.max_staleness and were dropped (10-14 of 64 a step, H100).
# An eighth of the samples drops ~1% in the schedule's simulation (experiments/bench/
# partial_schedule.py), at 128 slots the same stop as before.
TAIL_SAMPLES = 1 / 8
PARTIAL_TAIL = 0.5   # the most of the slots


def _resolve_tail(ro: RolloutOptions, rl: RLOptions) -> RolloutOptions:
    """`rollout.partial_tail=-1` (the default): with partial rollouts, the share of the slots
    that is TAIL_SAMPLES of a step's samples, at most PARTIAL_TAIL; without, 0. After
    `_resolve_slots`."""
    if ro.partial_tail >= 0:
        return ro
    if ro.partial_tail != -1:
        raise ValueError(f"rollout.partial_tail={ro.partial_tail}: a share of the slots in "
                         "[0, 1), or -1 for the default")
    share = min(PARTIAL_TAIL, TAIL_SAMPLES * rl.prompts_per_step * rl.group_size / ro.max_slots)
    return dataclasses.replace(ro, partial_tail=share if ro.partial else 0.0)


def _resolve_slots(ro: RolloutOptions, rl: RLOptions) -> RolloutOptions:
    """`rollout.max_slots=0` (the default): a step's samples, so none waits for a slot, at
    most AUTO_SLOTS."""
    if ro.max_slots:
        return ro
    return dataclasses.replace(ro, max_slots=min(rl.prompts_per_step * rl.group_size,
                                                 AUTO_SLOTS))


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
    """What multi-turn rollouts (`rollout.env`) do not run with yet: the video task and the
    one-step-off pipeline. PPO's GAE runs on them: the rows' loss mask is the model mask, and
    GAE's masked recurrence steps over the observations (`lrl.rl.gae`), as verl's multi-turn
    GAE does. A reward model scores the whole conversation, the environment's turns rendered
    as its messages (`lrl.trajectories.conversation`), weighted beside the environment's
    reward.
    Partial rollouts carry trajectories across steps (`lrl.partial_turns`), without kept KV
    pages (`rollout.partial_keep_kv` does not apply)."""
    ro = o.rollout
    if not ro.env:
        return
    from lrl.envs.base import get
    get(ro.env, "rollout.env")   # a registered name or "pkg.module:Factory"
    if o.task != "text":
        raise ValueError(f"rollout.env={ro.env!r} runs on the text task only, not task={o.task!r}")
    if o.pipeline.rollout_devices:
        raise ValueError(f"rollout.env={ro.env!r} is not built with pipeline.rollout_devices "
                         "> 0: multi-turn rollouts run on the training mesh, in synchronous or "
                         "partial steps")
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
    return schema.plain(config)

