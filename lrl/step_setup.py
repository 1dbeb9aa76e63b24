"""`Setup`: what every GRPO step uses, built once where the loop is built (`lrl.loop.build_grpo`)
and handed to both halves of the step, the collection (`lrl.collect`, `lrl.collect_partial`) and the learning
(`lrl.grpo`): options, the task, the compiled update and log-prob programs, the run's rollout
engine and the micro-batch shapes. T positions in a row."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every GRPO step uses, built once where the loop is built."""
    rl: object                    # options.RLOptions
    rollout: object               # options.RolloutOptions
    seed: int
    task: object                  # lrl.tasks: prepare / update_inputs
    tokenizer: object
    model_cfg: object
    mesh: object
    eos_ids: tuple
    pool: object                  # lrl.rewards.RewardPool
    update: object                # rl.update.UpdatePrograms, compiled per micro-batch shape
    logprobs: Optional[Callable]  # jitted (params, micro_batch, extra) -> logp_BT, when needed
    shards: int                   # data-parallel shards of the mesh (data x fsdp)
    row_len: int                  # T of a packed row
    rows_per_shard: int           # rows a data shard holds in one micro-batch
    max_segments: int             # sequences a row may hold (the attention's packed runs)
    max_len: Optional[int] = None # the loss's max_len (seq_mean_token_sum_norm)
    prefill: Optional[Callable] = None   # sequence-parallel prefill of long prompts
    ref_params: object = None     # the frozen reference, when KL is on
    engine: object = None         # the run's rollout engine (None: one per call, sized for it)
    decode: object = None         # rollout.weights.DecodeWeights for that engine
    # Benchmarks only: a sample's forced length, from its key (its prompt's ids as bytes, its
    # index in the group), as if its end token came there; a carried sample samples the rest.
    max_new_fn: Optional[Callable[[tuple], int]] = None
    # Row lengths below row_len a minibatch's last rows are cut to, longest first
    # (`lrl.rl.budget.row_lengths`); () cuts none.
    buckets: tuple = ()
    # PPO's state beside the policy's (`lrl.ppo.PPO`: the critic, the KL in the reward), when
    # rl.needs_ppo_pass; replaced in place as steps learn.
    ppo: object = None
    # The micro-batch shapes [B, T] the step's programs have run (`warm_up`).
    warmed: set = dataclasses.field(default_factory=set)
