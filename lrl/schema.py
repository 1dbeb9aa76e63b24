"""Every config field, declared once: its default, type, bound (or choices) and one-line doc.

A section is a frozen dataclass; a field is one line of it,

    page_size: int = field(16, "tokens of one KV-cache page", ge=1)

and a nested section (`rl.loss`, `critic.optim`) is `section(Loss, "doc")`, optionally with
other defaults. `configs/default.py` is `config_dict()` (these defaults as a ConfigDict) plus
its variants; `lrl.options` reads a config into these classes (each value checked against its
field, an error naming the key) and adds the cross-field rules and the step policy;
`--print_config` and `--help` print the docs from here. Nothing here imports jax, so a config
builds where only ml_collections is installed. How to add a field: docs/config.md.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Iterator, Mapping, Optional

# ----------------------------------------------------------------------------- declaring

_BOUNDS = ("ge", "gt", "lt", "le", "choices")


def field(default, doc: str, *, ge=None, gt=None, lt=None, le=None, choices=None):
    """One config field: its default, its doc, and the bounds or choices its value must
    respect (`ge`: >=, `gt`: >, `lt`: <, `le`: <=)."""
    meta = dict(doc=doc, ge=ge, gt=gt, lt=lt, le=le, choices=choices)
    if isinstance(default, (dict, list)):   # a fresh copy per instance
        return dataclasses.field(default_factory=lambda: _copy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls, doc: Optional[str] = None, **defaults):
    """A nested section of class `cls`, with some of its defaults replaced; its doc is `doc`,
    else the first paragraph of the class's docstring (the rest explains it at length)."""
    doc = doc if doc is not None else (cls.__doc__ or "").split("\n\n")[0]
    return dataclasses.field(default_factory=lambda: cls(**defaults),
                             metadata=dict(doc=doc, section=cls))


def _copy(x):
    return {k: _copy(v) for k, v in x.items()} if isinstance(x, dict) else (
        list(x) if isinstance(x, list) else x)


def _frozen(cls):
    """A section: a frozen dataclass whose docstring's first paragraph is its header."""
    return dataclasses.dataclass(frozen=True)(cls)


JOBS = ("grpo", "sft")
TASKS = ("text", "video")
DTYPES = ("float32", "bfloat16", "float16")
REMAT = ("none", "full", "dots", "dots_no_batch", "dots_attn", "save_attn", "offload_attn")
OVERLONG = ("none", "mask", "penalty")
SHARED_PROMPT = ("off", "on", "auto")   # lrl.data.shared_prompt.MODES (no jax imported here)

# ----------------------------------------------------------------------------- sections


@_frozen
class Model:
    """the policy model"""
    hf_path: str = field("", "a local HF checkpoint directory; empty: init from the fields below")
    model_type: str = field("qwen2", "architecture when initialising from scratch",
                            choices=("llama", "qwen2", "qwen3"))
    d_model: int = field(128, "hidden width", ge=1)
    n_layers: int = field(4, "decoder layers", ge=1)
    n_heads: int = field(4, "query heads", ge=1)
    n_kv_heads: int = field(2, "key/value heads (fewer than n_heads: grouped-query attention)",
                            ge=1)
    head_dim: int = field(32, "width of one attention head", ge=2)
    mlp_dim: int = field(384, "the MLP's hidden width", ge=1)
    vocab_size: int = field(0, "0: the tokenizer's; more pads the vocabulary (as Qwen's)", ge=0)
    rope_theta: float = field(10000.0, "RoPE's base", gt=0)
    tie_embeddings: bool = field(True, "the lm head reuses the token embedding")
    param_dtype: str = field("float32", "master weights", choices=DTYPES)
    dtype: str = field("float32", 'compute dtype ("bfloat16" on accelerators)', choices=DTYPES)
    attention: str = field("dense", "dense | ring | ulysses (ring/ulysses shard over mesh.seq)",
                           choices=("dense", "ring", "ulysses"))
    attention_impl: str = field("", '"" = cuDNN on GPU, XLA elsewhere; or "xla" / "cudnn"',
                                choices=("", "xla", "cudnn"))
    remat: str = field("full", " | ".join(REMAT), choices=REMAT)
    param_shard_axes: str = field("fsdp", '"fsdp,seq": the seq devices shard the parameters too')


@_frozen
class Tokenizer:
    """a local HF tokenizer dir, or "" to train one on the synthetic task"""
    path: str = field("", 'a local HF tokenizer directory; "" = the model directory\'s with '
                          "model.hf_path, else one trained on the synthetic task's text")
    vocab_size: int = field(300, "vocabulary of a tokenizer trained here", ge=2)


@_frozen
class Mesh:
    """the device mesh's sizes per axis; -1 = all remaining devices"""
    data: int = field(1, "data-parallel replicas", ge=-1)
    fsdp: int = field(-1, "devices that shard the parameters and optimizer state", ge=-1)
    seq: int = field(1, "devices one sequence is split over (ring / ulysses attention)", ge=-1)
    tensor: int = field(1, "tensor-parallel devices", ge=-1)


@_frozen
class Distributed:
    """multi-process runs (one process per host or per GPU); see experiments/launch/"""
    enabled: bool = field(False, "start jax.distributed")
    coordinator_address: str = field("", '"host:port" of process 0; "" = detect (SLURM, MPI, '
                                         "TPU)")
    num_processes: int = field(-1, "-1 = detect")
    process_id: int = field(-1, "-1 = detect")
    local_device_ids: str = field("", '"0,1,2,3": the GPUs this process drives; "" = JAX\'s '
                                      "choice")
    initialization_timeout_s: int = field(300, "wait this long for every process to connect",
                                          ge=1)
    heartbeat_timeout_s: int = field(100, "a silent peer is declared dead after this; the rest "
                                          "stop", ge=1)
    shutdown_timeout_s: int = field(300, "wait this long for the peers at exit", ge=1)
    cpu_collectives: str = field("gloo", "gloo | mpi | none (cross-process collectives on CPU)",
                                 choices=("gloo", "mpi", "none"))
    watchdog_s: float = field(0.0, "> 0: exit when no step finishes for this long", ge=0)


@_frozen
class Data:
    """the prompts: a synthetic task or local records"""
    source: str = field("synthetic", "synthetic | jsonl | parquet (video: synthetic | jsonl)")
    paths: str = field("", "comma-separated files or globs for jsonl/parquet")
    prompt_field: str = field("prompt", "the records' prompt field")
    answer_field: str = field("answer", "the records' reference-answer field")
    messages_field: str = field("", "a list of chat messages instead of a prompt string")
    system_prompt: str = field("", 'a system message before each prompt; "" = none')
    task: str = field("arithmetic", "synthetic task: kv_retrieval | arithmetic | tool_lookup "
                                    "(multi-turn, docs/tools-task.md) (video: direction | count)")
    task_kwargs: dict = field(dict(arithmetic=dict(num_terms=3, min_terms=2, max_operand=9),
                                   kv_retrieval=dict(num_pairs=4, min_pairs=2, key_len=2,
                                                     value_len=2),
                                   tool_lookup=dict(num_pairs=13, key_len=1, value_len=1)),
                              "per task; the chosen task's are used")
    size: int = field(100_000, "synthetic examples", ge=1)
    eval_size: int = field(64, "held-out synthetic examples (other seed)", ge=0)
    eval_paths: str = field("", "held-out jsonl/parquet for real data")
    max_prompt_len: int = field(160, "longer prompts are dropped and counted", ge=1)


@_frozen
class SFT:
    """the warm start of a GRPO job, or the whole of an "sft" job"""
    steps: int = field(300, "0 = no warm start", ge=0)
    rows: int = field(8, "packed rows per step", ge=1)
    row_len: int = field(512, "tokens of a packed row", ge=2)
    answer_noise: float = field(0.3, "synthetic SFT demos that reason right but box a wrong "
                                     "answer", ge=0, le=1)
    lr: float = field(3e-3, "peak learning rate", gt=0)
    warmup_steps: int = field(20, "steps of linear warm-up", ge=0)
    paths: str = field("", 'prompt/response records for an "sft" job on real data')
    response_field: str = field("response", "the records' response field")


@_frozen
class KLControl:
    """the KL-in-reward coefficient's controller (verl's algorithm.kl_ctrl)"""
    type: str = field("fixed", "fixed | adaptive (verl's AdaptiveKLController)",
                      choices=("fixed", "adaptive"))
    coef: float = field(0.001, "beta; the adaptive controller's start", ge=0)
    target_kl: float = field(0.1, "adaptive: the KL per sequence it steers to", gt=0)
    horizon: int = field(10000, "adaptive: samples over which beta moves by its error", ge=1)
    estimator: str = field("k1", "k1 | k2 | k3 | low_var_kl (verl's kl_penalty)",
                           choices=("k1", "k2", "k3", "low_var_kl"))


@_frozen
class Loss:
    """the policy loss"""
    clip_low: float = field(0.2, "PPO clip: the ratio's lower bound is 1 - clip_low", ge=0, lt=1)
    clip_high: float = field(0.28, "... and its upper 1 + clip_high (DAPO's clip-higher)", ge=0)
    dual_clip: float = field(0.0, "0.0 = off; else > 1: caps -A·ratio at -c·A where A < 0",
                             ge=0)
    ratio_level: str = field("token", "token | sequence (GSPO)", choices=("token", "sequence"))
    aggregation: str = field("seq_mean_token_mean", "token_mean | seq_mean_token_mean | "
                             "seq_mean_token_sum_norm", choices=(
                                 "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"))
    kl_coef: float = field(0.0, "KL to the frozen reference (0.0: no reference is kept)", ge=0)
    kl_estimator: str = field("k3", "k1 | k2 | k3", choices=("k1", "k2", "k3"))
    entropy_coef: float = field(0.0, "entropy bonus")
    # Rollout correction (lrl/rl/correction.py): the ratio old / sampler of the trainer's and
    # the sampler's log-probs; turning either on takes the old log-probs from a trainer
    # forward (rl.old_logp "trainer").
    tis_cap: float = field(0.0, "truncated IS: the policy term weighs min(ratio, cap); 0.0 = off",
                           ge=0)
    tis_level: str = field("token", "token | sequence (product of the ratios) | geometric (their "
                           "geometric mean): the ratio tis_cap caps",
                           choices=("token", "sequence", "geometric"))
    mask_level: str = field("none", "none | token | sequence | geometric: drop a token, or a "
                            "whole sequence, whose ratio at that level leaves [mask_low, "
                            "mask_high] (masked IS; denominators kept)",
                            choices=("none", "token", "sequence", "geometric"))
    mask_low: float = field(0.5, "lower end of the band (<= 1)", gt=0, le=1)
    mask_high: float = field(2.0, "upper end of the band (>= 1)", ge=1)
    staleness_decay: float = field(1.0, "a sample's policy term weighs decay ** age (age: policy "
                                   "versions behind the trainer); 1.0 = off", gt=0, le=1)
    max_staleness: int = field(-1, "samples older than this weigh 0; -1 = no bound", ge=-1)
    policy_loss: str = field("ppo_clip", 'the per-token policy term: ppo_clip (PPO clip with the '
                             'options above) | a registered name or "pkg.module:fn" '
                             "(docs/extending.md); aggregation, KL, entropy and the rollout "
                             "correction apply to it alike")


@_frozen
class RL:
    """GRPO and its relatives: sampling, advantages, the update's batching and loss"""
    steps: int = field(80, "RL steps", ge=0)
    prompts_per_step: int = field(16, "P", ge=1)
    group_size: int = field(16, "G: a larger group sees more of a prompt's answers", ge=1)
    max_new_tokens: int = field(40, "tokens a completion may have", ge=1)
    temperature: float = field(1.0, "sampling temperature", ge=0)
    top_k: int = field(0, "sample from the k likeliest tokens; 0 = all", ge=0)
    top_p: float = field(1.0, "nucleus sampling's mass; 1.0 = all", gt=0, le=1)
    estimator: str = field("grpo", "grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_token | "
                           "remax (also samples one greedy baseline per prompt) | a registered "
                           'name or "pkg.module:fn" (docs/extending.md) | gae (PPO: a critic, '
                           "the `critic` section; docs/ppo.md)")
    epochs: int = field(1, "passes over each rollout batch", ge=1)
    minibatches: int = field(2, "optimizer steps per epoch (the step's samples split evenly)",
                             ge=1)
    row_len: int = field(512, "packed row length for the update; 0 = the token budget", ge=0)
    max_tokens_per_micro: int = field(4096, "tokens a data shard takes per micro-batch (rows of "
                                      "row_len); 0 = the most device memory holds, derived at "
                                      "start-up from the compiled update (one row on a CPU)",
                                      ge=0)
    logprob_chunk: int = field(1024, "positions of every row per step of the log-prob scan", ge=1)
    fused_head: bool = field(True, "loss gradient formed in the lm head's forward (no logit "
                             "recompute; token-level ratios only, GSPO goes unfused)")
    recompute_old_logp: bool = field(False, "True: old log-probs from a trainer forward, not the "
                                     "sampler")
    dynamic_sampling: bool = field(False, "DAPO: drop groups whose rewards are all equal, draw "
                                   "more")
    max_resample: int = field(2, "extra prompt batches dynamic sampling may draw per step "
                              "(partial rollouts: extra decode rounds, each may admit one)", ge=0)
    overlong: str = field("none", "none | mask | penalty (DAPO overlong handling)",
                          choices=OVERLONG)
    overlong_buffer: int = field(8, "penalty ramps over the last N tokens of the limit", ge=0)
    overlong_penalty: float = field(1.0, "the penalty at the limit (it ramps up from 0)", ge=0)
    mismatch_fraction: float = field(1.0, "share of a step's micro-batches whose trainer forward "
                                     "is compared with the sampler's log-probs (mismatch/ "
                                     "metrics): the update's own forward on its first minibatch "
                                     "(the one under the weights that sampled), or the old "
                                     "log-probs' pass (all micro-batches) when it runs; free "
                                     "either way; 0 = no mismatch metrics", ge=0, le=1)
    shared_prompt: str = field("off", "off | on | auto: a group's prompt held once per update "
                               "row and computed once, not G times (lrl.data.shared_prompt); "
                               "auto: for groups whose prompt is longer than their mean "
                               "response. Exact: the same loss and gradients",
                               choices=SHARED_PROMPT)
    gamma: float = field(1.0, "gae: discount of the token rewards (verl's algorithm.gamma)",
                         ge=0, le=1)
    lam: float = field(1.0, "gae: GAE's lambda (verl's algorithm.lam)", ge=0, le=1)
    kl_in_reward: bool = field(False, "subtract beta * KL(old || ref) from each token's reward "
                               "(any estimator; outcome ones see R - beta * sum KL)")
    kl_ctrl: KLControl = section(KLControl, "the KL-in-reward coefficient's controller")
    loss: Loss = section(Loss, "the policy loss")


@_frozen
class Optim:
    """the optimizer of the GRPO phase"""
    lr: float = field(1e-4, "peak learning rate (AdamW)", gt=0)
    warmup_steps: int = field(5, "steps of linear warm-up", ge=0)
    weight_decay: float = field(0.0, "AdamW's decoupled weight decay", ge=0)
    b1: float = field(0.9, "Adam's first-moment decay", ge=0, lt=1)
    b2: float = field(0.99, "Adam's second-moment decay", ge=0, lt=1)
    clip_norm: float = field(1.0, "gradients clipped to this global norm", ge=0)
    offload: str = field("auto", "fp32 masters and Adam moments in pinned host memory, "
                         "streamed a layer at a time by the optimizer step: 'auto' when the "
                         "device cannot hold them (never on CPU), 'on', 'off' "
                         "(docs/offload.md)", choices=("auto", "on", "off"))
    grad_sink: str = field("auto", "the policy update adds each layer's weight gradient into "
                           "the accumulator inside the backward, recomputing each layer whole "
                           "(the compute of remat='full'), instead of stacking all of them first "
                           "(one copy of the layers' weights less): 'auto' when the optimizer "
                           "is offloaded or model.remat='full', 'on', 'off' "
                           "(lrl/models/grad_sink.py)", choices=("auto", "on", "off"))


@_frozen
class Critic:
    """PPO's critic, trained with rl.estimator="gae" (lrl/rl/critic.py, docs/ppo.md)

    The policy's decoder with a value head, on the same mesh and micro-batches, with its own
    optimizer."""
    hf_path: str = field("", '"": the policy\'s weights as this phase starts; else a HF '
                         "*ForTokenClassification (1 label) or *ForSequenceClassification "
                         "checkpoint (its score head)")
    head_init_std: float = field(0.0, "the value head starts at zero (0.0) or N(0, std^2)", ge=0)
    remat: str = field("", '"": the policy\'s remat policy; else one of model.remat\'s',
                       choices=("",) + REMAT)
    warmup_steps: int = field(0, "first steps update the critic alone (verl's critic_warmup)",
                              ge=0)
    ppo_epochs: int = field(1, "critic passes over each step's minibatches", ge=1)
    cliprange_value: float = field(0.5, "value clip around the old values (verl's 0.5)", ge=0)
    optim: Optim = section(Optim, "the critic's optimizer (offload and grad_sink: never, "
                           "it stays on the device and stacks its gradients)", lr=1e-5,
                           warmup_steps=0, b2=0.999, offload="off")


@_frozen
class RewardModel:
    """a reward model, the spec's "rm" term (e.g. spec="math:0.8,rm:0.2"), scored on the mesh in
    its own chat template (docs/reward-models.md)"""
    hf_path: str = field("", 'a *ForSequenceClassification directory; "" = none')
    tokenizer_path: str = field("", '"" = the reward model\'s directory')
    max_len: int = field(4096, "tokens of its packed rows; longer conversations are cut", ge=16)
    batch_rows: int = field(8, "rows of one forward call (a multiple of data x fsdp)", ge=1)
    dtype: str = field("bfloat16", "its compute dtype", choices=DTYPES)


@_frozen
class Reward:
    """[(registry name, weight), ...] scored in a worker pool"""
    spec: str = field("synthetic:1.0", '"name:weight,name:weight"')
    num_workers: int = field(2, "worker processes; 0 scores in the calling process", ge=0)
    timeout_s: float = field(10.0, "one scoring call's time limit (a timeout scores 0)", gt=0)
    fail_frac: float = field(1.0, "share of a scoring call's items failing that fails the call",
                             gt=0, le=1)
    fail_patience: int = field(3, "that many failed calls in a row stop the run; 0: never", ge=0)
    model: RewardModel = section(RewardModel, 'the spec\'s "rm" term (docs/reward-models.md)')


@_frozen
class Rollout:
    """the rollout engine: KV pages, slots, prefill; partial rollouts

    Built once for the run: its pool, compiled programs and decode-layout weights are kept."""
    page_size: int = field(16, "tokens of one KV-cache page", ge=1)
    max_slots: int = field(0, "samples decoded at once; 0 = a step's samples "
                           "(rl.prompts_per_step x rl.group_size), at most 512", ge=0)
    pool_tokens: int = field(0, "KV pool in tokens; 0: from pool_fraction", ge=0)
    pool_fraction: float = field(0.4, "share of the device memory the train state leaves, for "
                                 "the pool (capped at every slot's longest sample; a CPU, which "
                                 "reports no memory, gets exactly that)", gt=0, le=1)
    prefill_tokens: int = field(2048, "tokens of one prefill call: prompts share its rows", ge=16)
    sp_min_tokens: int = field(0, "with ring/ulysses over seq > 1: prompts of at least this many "
                               "tokens are prefilled sequence-parallel", ge=0)
    narrow_decode: bool = field(True, "the tail's decode calls compute only the live slots' rows "
                                "(programs for a quarter, a sixteenth, ... of the slots)")
    overlap_admission: bool = field(True, "while samples wait, launch the next decode call before "
                                    "collecting the last, so the host's bookkeeping runs while "
                                    "the device decodes (a freed slot is refilled a call later); "
                                    "False: collect each call, then refill")
    partial: bool = field(False, "partial rollouts: a step's rollout stops once "
                          "rl.prompts_per_step groups have finished (or partial_tokens are "
                          "spent) instead of waiting for the longest sample; the unfinished "
                          "samples carry on in the next step under the new weights, each token "
                          "keeping the log-prob and version of the policy that drew it (text "
                          "task only)")
    partial_tokens: int = field(0, "decode tokens one step's rollout samples at most (checked "
                                "after each decode call is collected, with the next one, "
                                "overlap_admission's, in flight); 0 = stop on finished groups "
                                "only", ge=0)
    partial_tail: float = field(-1.0, "also stop once no sample waits and fewer than this share "
                                "of the slots are live (the tail); 0 = never; -1 = with "
                                "partial, an eighth of a step's samples, at most half the "
                                "slots (docs/partial-rollouts.md)", ge=-1, lt=1)
    partial_seconds: float = field(0.0, "also stop once the rollout has run this long (checked "
                                   "after each decode call); 0 = no time budget", ge=0)
    partial_backlog: float = field(0.0, "> 0: new prompts are drawn until the unfinished samples "
                                   "fill the slots (at most a step's samples) and this many "
                                   "steps' samples wait behind them, to refill the slots the "
                                   "step's finishing samples free (fuller slots, older groups: "
                                   "more dropped at max_staleness); 0 = a batch while the slots "
                                   "are not full (they drain before the step stops)", ge=0)
    max_staleness: int = field(2, "a carried group whose oldest token is more than this many "
                               "steps old is dropped (and counted), never trained", ge=0)
    partial_keep_kv: bool = field(True, "with partial: a carried sample's KV pages stay in the "
                                  "engine's pool and it resumes without a prefill (its KV then "
                                  "is the old policy's; False: prefilled again under the new "
                                  "weights); pages short: prefilled anyway")
    # Multi-turn rollouts with tools (lrl.trajectories, lrl.envs, docs/environments.md)
    env: str = field("", '"" = one response per sample; a registered environment (lrl.envs: '
                     '"tools", or "pkg.module:Factory") over several model turns')
    max_turns: int = field(4, "model turns a trajectory has at most", ge=1)
    max_turn_tokens: int = field(0, "tokens one model turn samples at most; 0 = no cap (the "
                                 "trajectory's cap, rl.max_new_tokens, still holds)", ge=0)
    tool_timeout_s: float = field(10.0, "an environment step longer than this ends the "
                                  "trajectory (a timeout)", gt=0)
    turn_reward: str = field("sum", "the trajectory's reward: final + per-turn rewards, summed "
                             "(sum) or each turn's weighed turn_discount ** turn (discount)",
                             choices=("sum", "discount"))
    turn_discount: float = field(1.0, 'per-turn weight with turn_reward="discount"', gt=0, le=1)


@_frozen
class Pipeline:
    """the one-step-off pipeline (lrl.pipeline): step t+1 sampled on split-off devices

    verl's one_step_off_policy trainer: the devices split into two meshes, and the rollout of
    step t+1 runs on the rollout devices while the training devices update on step t's batch.
    Step t then trains on samples drawn with the weights of step t-1 (each sample's age is 1;
    the first step of a run, whose batch nothing sampled ahead, samples synchronously, age 0);
    the sampler's log-probs and the rollout correction (`rl.loss.tis_cap`, `mask_level`,
    `staleness_decay`) apply to them as to any behaviour policy's. The new weights go to the
    rollout devices device to device after each update.

    `rollout_devices`: 0 (the default) runs every step on one mesh of every device, rollout and
    update in turn; n >= 1 gives the last n devices to the rollout and shapes the rest with the
    `mesh.*` sizes (so at least 2 devices; one GPU cannot split). `rollout_tensor`: the
    rollout mesh's tensor-parallel size (0: all n; its other devices hold copies), which must
    divide n and the training device count (the weights are gathered on the training devices
    into the rollout's tensor slices, then copied). Single process, text task, without
    `rollout.partial` (`options._check_pipeline`). A checkpoint saves the batch sampled ahead
    (finished, scored) with the state, so a resume trains exactly what the run would have;
    docs/sampler-trainer.md."""
    rollout_devices: int = field(0, "0 = off; n = the last n devices sample, the rest train "
                                 "(shaped by mesh.*, whose -1 counts only those)", ge=0)
    rollout_tensor: int = field(0, "the rollout mesh's tensor size; 0 = all n devices", ge=0)


@_frozen
class Eval:
    """evaluation on held-out prompts"""
    every: int = field(10, "steps between evaluations; 0 = none", ge=0)
    num_prompts: int = field(64, "held-out prompts per evaluation", ge=1)
    k: int = field(4, "samples per prompt (pass@k)", ge=1)
    temperature: float = field(1.0, "sampling temperature", ge=0)


@_frozen
class Checkpoint:
    """saved by orbax under <workdir>/checkpoints; a restart resumes from the newest"""
    every_steps: int = field(20, "save every this many steps; 0 = not by steps", ge=0)
    every_minutes: float = field(0.0, "save when this long has passed since the last; 0 = not by "
                                 "time", ge=0)
    keep: int = field(2, "checkpoints kept", ge=1)
    contents: str = field("full", "full = weights and optimizer state (an exact resume); "
                          "weights = the master weights only, a third of an Adam state's "
                          "size: export reads them, a resume restarts the optimizer",
                          choices=("full", "weights"))


@_frozen
class Metrics:
    """metrics.jsonl, samples.jsonl, TensorBoard, Weights & Biases"""
    tensorboard: bool = field(True, "write TensorBoard events")
    samples_per_step: int = field(2, "completions a step writes to samples.jsonl", ge=0)
    wandb_project: str = field("", "a Weights & Biases project: steps, config and output files "
                               'logged there too (pip install wandb); "" = off')
    wandb_entity: str = field("", '"" = your default entity')
    wandb_name: str = field("", 'the W&B run\'s name; "" = the workdir\'s name')
    wandb_mode: str = field("online", "online | offline (under <workdir>/wandb, `wandb sync`)",
                            choices=("online", "offline"))


@_frozen
class Video:
    """the video task's own section: frames and the vision tower (configs/video_synthetic.py)"""
    frames_in_file: int = field(8, "synthetic videos: frames written per video", ge=2)
    frame: int = field(112, "synthetic videos: square frame side in pixels", ge=28)
    num_frames: int = field(4, "frames sampled per video (2 per temporal patch)", ge=2)
    min_tokens_per_frame: int = field(4, "merged 28x28 tokens a frame may resize to", ge=1)
    max_tokens_per_frame: int = field(16, "... and at most", ge=1)
    cache_dir: str = field("", '"" = in-memory embedding cache; a path = on disk too')
    cache_gib: float = field(4.0, "device memory the in-memory cache holds at most (least "
                             "recently used dropped; 0 = none kept, the disk's only)", ge=0)
    frame_axes: str = field("", 'mesh axes the vision tower splits frames over; "" = all')
    mrope_section: tuple = field((2, 3, 3), "(t, h, w) frequency sections, summing to head_dim "
                                 "/ 2")
    vision_depth: int = field(2, "the random vision tower's blocks (a checkpoint brings its own)",
                              ge=1)
    vision_width: int = field(32, "its width", ge=1)
    vision_heads: int = field(2, "its attention heads", ge=1)
    vision_mlp_dim: int = field(64, "its MLP's hidden width", ge=1)
    video_field: str = field("video", "video-QA jsonl: a local video path (absolute, or relative "
                             "to video_root)")
    choices_field: str = field("choices", "video-QA jsonl: a list of options; rows without it "
                               "are open")
    video_root: str = field("", 'relative video paths are read against this ("" = the jsonl\'s '
                            "own directory)")
    instruction: str = field("Answer with \\boxed{...}.", "appended to an open question")
    choice_instruction: str = field("Answer with the option's letter in \\boxed{}.",
                                    "appended to a multiple-choice question")


@_frozen
class Config:
    """the whole config: run-wide fields, then one section each"""
    job: str = field("grpo", '"grpo" (optionally after an SFT warm start) or "sft"', choices=JOBS)
    task: str = field("text", '"text" prompts, or "video" (configs/video_synthetic.py)',
                      choices=TASKS)
    seed: int = field(0, "seeds the model's initialisation, the data order and the sampling")
    compile_cache: str = field("auto", "compiled programs (and the update's memory-derived "
                               'budget) kept for the next start: "auto" = .lrl-cache beside the '
                               'workdir, or a folder; "" = off (lrl/compile_cache.py)')
    model: Model = section(Model)
    tokenizer: Tokenizer = section(Tokenizer)
    mesh: Mesh = section(Mesh)
    distributed: Distributed = section(Distributed)
    data: Data = section(Data)
    sft: SFT = section(SFT)
    rl: RL = section(RL)
    optim: Optim = section(Optim)
    critic: Critic = section(Critic)
    reward: Reward = section(Reward)
    rollout: Rollout = section(Rollout)
    pipeline: Pipeline = section(Pipeline)
    eval: Eval = section(Eval)
    checkpoint: Checkpoint = section(Checkpoint)
    metrics: Metrics = section(Metrics)
    video: Optional[Video] = dataclasses.field(   # only with task="video"
        default=None, metadata={**section(Video).metadata})


# ----------------------------------------------------------------------------- reading

def fields(cls) -> tuple:
    return dataclasses.fields(cls)


def nested(f) -> Optional[type]:
    """The section class of a nested-section field, else None."""
    return f.metadata.get("section")


def walk(cls=None, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """("rl.loss.clip_low", its field), ...: every field and nested section of `cls` (default:
    the whole config), in declaration order."""
    for f in dataclasses.fields(Config if cls is None else cls):
        yield prefix + f.name, f
        if nested(f) is not None:
            yield from walk(nested(f), f"{prefix}{f.name}.")


def docs(cls=None) -> dict:
    """{"rl.group_size": "G: ...", "rl.loss": "the policy loss", ...} in declaration order."""
    return {path: " ".join(f.metadata["doc"].split()) for path, f in walk(cls)}


def config_dict(values=None):
    """The defaults of a section (an instance or a class; default: the whole config) as a
    ConfigDict; a section left None (video) is left out."""
    import ml_collections
    values = Config() if values is None else values
    if isinstance(values, type):
        values = values()
    out = {}
    for f in dataclasses.fields(values):
        v = getattr(values, f.name)
        if v is None and nested(f) is not None:
            continue
        out[f.name] = config_dict(v) if nested(f) is not None else _copy(v)
    return ml_collections.ConfigDict(out)


def check_value(key: str, value, meta: Mapping) -> None:
    """`value` within the field's bounds and choices, else a ValueError naming `key`."""
    bounds = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("lt", lambda v, b: v < b, "<"), ("le", lambda v, b: v <= b, "<="))
    for name, ok, sign in bounds:
        b = meta.get(name)
        if b is not None and not ok(value, b):
            raise ValueError(f"{key}={value!r}: must be {sign} {b}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{key}={value!r}; choose one of {tuple(choices)}")


def coerce(key: str, value, kind):
    """The config value as the field's type; bools are not numbers here."""
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
    if kind is tuple or typing.get_origin(kind) is tuple:
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{key}={value!r}: expected a tuple")
        return tuple(value)
    if kind is dict or typing.get_origin(kind) is dict:
        return plain(value)
    return value


def plain(x):
    """A ConfigDict (or mapping) as nested plain dicts."""
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if isinstance(x, Mapping):
        return {k: plain(v) for k, v in x.items()}
    return x


def read(cls, section, prefix: str, typed: Optional[Mapping] = None,
         renamed: Optional[Mapping] = None):
    """`cls` (or its typed subclass in `typed`) from a config section: every field present, no
    key unknown, each value coerced to its type and checked against its bounds; nested
    sections read the same way. `renamed`: {"rl.old_key": "why"} for keys that moved."""
    typed, renamed = typed or {}, renamed or {}
    if section is None:
        raise ValueError(f"config has no {prefix!r} section")
    if not hasattr(section, "items"):
        raise ValueError(f"{prefix}={section!r}: expected a section of fields "
                         f"{[f.name for f in dataclasses.fields(cls)]}")
    given = dict(section.items())
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(given) - set(names))
    moved = {k: renamed[f"{prefix}.{k}"] for k in unknown if f"{prefix}.{k}" in renamed}
    if moved:
        raise ValueError("; ".join(f"{prefix}.{k}: {why}" for k, why in moved.items()))
    missing = sorted(set(names) - set(given))
    if unknown or missing:
        raise ValueError(f"config section {prefix!r}: unknown keys {unknown} / missing keys "
                         f"{missing}; its keys are {names}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if nested(f) is not None:
            values[f.name] = read(nested(f), given[f.name], key, typed, renamed)
            continue
        v = coerce(key, given[f.name], hints[f.name])
        check_value(key, v, f.metadata)
        values[f.name] = v
    return typed.get(cls, cls)(**values)
