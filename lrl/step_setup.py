"""What a GRPO step reads and what it changes, as two types, both made where the phase is
built (`lrl.build.grpo`) and handed to both halves of the step, the collection
(`lrl.collect`, `lrl.collect_partial`) and the learning (`lrl.grpo`):

- `Setup` (frozen, built once): options, the task, the compiled update and log-prob
  programs, the run's rollout engine and the micro-batch shapes;
- `Live` (mutable, owned by the loop beside the policy's `TrainState`): what the steps change
  as they go, the micro-batch shapes the programs have run and PPO's state.

T positions in a row.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:
    from jax.sharding import Mesh
    from transformers import PreTrainedTokenizerBase

    from lrl.compiles import Background
    from lrl.models.config import ModelConfig
    from lrl.options import RLOptions, RolloutOptions
    from lrl.ppo import PPO
    from lrl.rewards.model import ModelRewardPool
    from lrl.rewards.pool import RewardPool
    from lrl.rl.update import UpdatePrograms
    from lrl.rollout.engine import Engine
    from lrl.rollout.weights import DecodeWeights
    from lrl.tasks.text import TextTask
    from lrl.tasks.video import VideoTask

# A parameter tree (the model's `params`: nested dicts of arrays).
Params = Any


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every GRPO step uses, built once where the phase is built."""
    rl: RLOptions
    rollout: RolloutOptions
    seed: int
    task: Union[TextTask, VideoTask]   # prepare / update_inputs / hidden
    tokenizer: PreTrainedTokenizerBase
    model_cfg: ModelConfig
    mesh: Mesh
    eos_ids: tuple[int, ...]
    pool: Union[RewardPool, ModelRewardPool]
    update: UpdatePrograms        # compiled per micro-batch shape
    logprobs: Optional[Callable]  # jitted (params, micro_batch, extra) -> logp_BT, when needed
    shards: int                   # data-parallel shards of the mesh (data x fsdp)
    row_len: int                  # T of a packed row
    rows_per_shard: int           # rows a data shard holds in one micro-batch
    max_segments: int             # sequences a row may hold (the attention's packed runs)
    max_len: Optional[int] = None # the loss's max_len (seq_mean_token_sum_norm)
    prefill: Optional[Callable] = None   # sequence-parallel prefill of long prompts
    ref_params: Optional[Params] = None  # the frozen reference, when KL is on
    engine: Optional[Engine] = None      # the run's rollout engine (None: one per call)
    decode: Optional[DecodeWeights] = None   # the decode-layout weights for that engine
    # Benchmarks only: a sample's forced length, from its key (its prompt's ids as bytes, its
    # index in the group), as if its end token came there; a carried sample samples the rest.
    max_new_fn: Optional[Callable[[tuple], int]] = None
    # Row lengths below row_len a minibatch's last rows are cut to, longest first
    # (`lrl.rl.budget.row_lengths`); () cuts none.
    buckets: tuple[int, ...] = ()
    # The update's shapes compiling on a thread while the first rollout runs (`build.setup`);
    # the first warm-up waits for them (`lrl.grpo.warm_up`).
    ahead: Optional[Background] = None


@dataclasses.dataclass
class Live:
    """What a GRPO phase's steps change as they run, beside the policy's `TrainState`: kept by
    the loop (and a checkpoint saves PPO's part), passed to each step."""
    # PPO's state (`lrl.ppo.PPO`: the critic's programs and train state, the KL in the
    # reward's coefficient, the steps learnt), when rl.needs_ppo_pass; its critic state and
    # coefficient are replaced as steps learn.
    ppo: Optional[PPO] = None
    # The micro-batch shapes [B, T] the step's programs have run (`lrl.grpo.warm_up`).
    warmed: set[tuple[int, int]] = dataclasses.field(default_factory=set)
