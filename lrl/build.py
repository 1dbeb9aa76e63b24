"""Everything that turns the options into what the loop runs, in the order it runs (as
big_vision's `main()` reads): the options (the meshes come from `lrl.mesh.build_meshes`, which
`preflight.start` calls before anything is written; the task from `lrl.tasks.build`, which
the loop calls next: what differs between text and video), the optimizers and the train
states' shardings, the reward pool, then a GRPO phase's `Setup` — the update's model config
and programs, the frozen reference, PPO's critic, the micro-batch token budget, the rollout
engine in what that budget leaves, the log-prob pass and the sequence-parallel prefill — and,
with `pipeline.rollout_devices`, the one-step-off pipeline's rollout half.

    options -> [meshes, task] -> optimizers -> restore_targets / train_state -> reward_pool
    grpo: update_model_config -> update programs -> reference -> _ppo -> the smallest
          micro-batch's need (_need_fn) -> _engine in what it leaves -> _token_budget
          -> log-prob pass, prefill -> (Setup, Live)
    pipeline: handover -> _engine on the rollout mesh -> Pipeline

Each builder is a plain function of the options (and of what was built before it); nothing
here holds state of its own. The loop takes `grpo` as an argument (`lrl.loop.run(...,
build=...)`), so a benchmark or a test wraps it rather than reassigning it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING, Optional

import jax

from lrl import checkpoint as ckpt_lib
from lrl import compile_cache, compiles, errors, grpo as grpo_lib, ppo as ppo_lib, step_setup
from lrl import mesh as mesh_lib
from lrl import options as options_lib
from lrl import pipeline as pipeline_lib
from lrl import rollout as rollout_lib
from lrl.data import packing
from lrl.models import flash as flash_lib
from lrl.models import grad_sink as grad_sink_lib
from lrl.rl import budget as budget_lib
from lrl.rl import offload as offload_lib
from lrl.rl import optim as optim_lib
from lrl.rl import train as train_lib
from lrl.rl import update as update_lib
from lrl.rollout import pages as pages_lib
from lrl.rollout import sp_prefill
from lrl.rollout import weights as weights_lib
from lrl.rollout.pages import pages_for

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from lrl.metrics import MetricsWriter
    from lrl.tasks.text import TextTask
    from lrl.tasks.video import VideoTask

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- options

def options(config, check_files: bool = True) -> options_lib.Options:
    """The typed, frozen options of a config, every field and file checked (see
    `lrl.options`); what the loop passes down instead of the ConfigDict."""
    return options_lib.from_config(config, check_files=check_files)


@dataclasses.dataclass
class Run:
    """What every phase needs; the loop makes it once, from the options, the meshes, the task
    and the run's checkpoint manager, preemption guard and metrics writer."""
    opts: options_lib.Options
    config: dict                  # the config as plain data, saved with each checkpoint
    workdir: str
    mesh: Mesh
    task: TextTask | VideoTask
    ckpt: ckpt_lib.CheckpointManager
    guard: ckpt_lib.PreemptionGuard
    writer: MetricsWriter
    rollout_mesh: Optional[Mesh] = None   # the one-step-off pipeline's (`lrl.pipeline`)
    cache: compile_cache.Cache = dataclasses.field(   # programs and budgets kept on disk
        default_factory=lambda: compile_cache.Cache(None))

    @property
    def eos_ids(self) -> tuple:
        cfg, tok = self.task.model_cfg, self.task.tokenizer
        return tuple(int(e) for e in (cfg.eos_token_ids or (tok.eos_token_id,)))


# ----------------------------------------------------------------------------- train states

def offload(o: options_lib.OptimOptions, model_cfg, mesh):
    """-> (the model config when `optim.offload` puts masters and moments in host memory,
    else None; why), by `lrl.rl.offload.decide_for`."""
    on, why = offload_lib.decide_for(o.offload, model_cfg, mesh)
    # The run's banner says it when on (lrl.loop); off, the plain run's case, stays quiet.
    (log.info if on else log.debug)("optimizer offload %s (%s)", "on" if on else "off", why)
    return (model_cfg if on else None), why


def optimizers(opts: options_lib.Options, offload_cfg=None, split_rest: bool = False) -> tuple:
    """-> (the SFT phase's optimizer or None, the GRPO phase's). Both have the same structure
    (only the schedules differ), so one abstract state restores either phase's checkpoint.
    `offload_cfg`: `offload`'s model config, when the masters live in host memory;
    `split_rest`: the parameters are not sharded (`lrl.rl.offload.Offload`)."""
    sft_steps, rl_steps = opts.sft.steps, opts.rl_steps
    kw = dict(offload_cfg=offload_cfg, split_rest=split_rest)
    sft_tx = optim_lib.for_phase(opts.optim, sft_steps, lr=opts.sft.lr,
                                 warmup=opts.sft.warmup_steps, **kw) if sft_steps else None
    rl_tx = optim_lib.for_phase(opts.optim, rl_steps, **kw) if rl_steps else sft_tx
    return sft_tx, rl_tx


def restore_targets(r: Run, tx) -> tuple[train_lib.TrainState, dict]:
    """What a restore reads: the policy's abstract train state (shardings from shapes) and
    the further items a GRPO checkpoint keeps — PPO's critic and the frozen reference — where
    a step has them (an SFT step has neither)."""
    opts = r.opts
    abstract = train_lib.abstract_train_state(r.task.model_cfg, tx, r.mesh)
    trees = {}
    if opts.rl_steps and opts.rl.uses_critic:
        trees["critic"] = ppo_lib.abstract_critic(opts, r.task.model_cfg, r.mesh)
    if opts.rl_steps and (opts.rl.loss.kl_coef or opts.rl.kl_in_reward):
        trees["reference"] = abstract.params
    return abstract, trees


def train_state(r: Run, params, tx) -> train_lib.TrainState:
    """A phase starts its own optimizer (and step count) on the params it is given."""
    return train_lib.place_train_state(
        params, tx, train_lib.train_state_shardings(r.task.model_cfg, tx, r.mesh))


# ----------------------------------------------------------------------------- rewards, loss

def reward_pool(opts: options_lib.Options, mesh=None):
    """The rule terms' worker pool; with a reward model (`reward.model.hf_path`), that pool
    and the model on `mesh` together (`lrl.rewards.model.ModelRewardPool`)."""
    from lrl.rewards import RewardPool
    r = opts.reward
    if not r.model.hf_path:
        return RewardPool(r.spec, num_workers=r.num_workers, timeout_s=r.timeout_s,
                          fail_frac=r.fail_frac, fail_patience=r.fail_patience)
    from lrl.rewards import model as rm_lib
    rules, weight = rm_lib.split_spec(r.spec)
    kw = dict(num_workers=r.num_workers, timeout_s=r.timeout_s, fail_frac=r.fail_frac,
              fail_patience=r.fail_patience)
    pool = RewardPool(rules, **kw) if rules else None
    # A multi-turn rollout's environment steps run in worker processes with timeouts even
    # when no rule term scores anything: a pool of their own (its `rm` term never asked).
    workers = (RewardPool(rm_lib.MODEL_TERM, **kw) if pool is None and opts.rollout.env
               else None)
    rm = rm_lib.load(r.model, mesh, attention=opts.model.attention)
    return rm_lib.ModelRewardPool(pool, rm, weight, workers=workers)


def loss_config(opts: options_lib.Options):
    from lrl.rl.losses import LossConfig
    L = opts.rl.loss
    return LossConfig(clip_low=L.clip_low, clip_high=L.clip_high,
                      dual_clip=L.dual_clip or None, ratio_level=L.ratio_level,
                      aggregation=L.aggregation, max_len=opts.rl.max_new_tokens,
                      kl_coef=L.kl_coef, kl_estimator=L.kl_estimator,
                      entropy_coef=L.entropy_coef, tis_cap=L.tis_cap or None,
                      tis_level=L.tis_level,
                      mask_level=None if L.mask_level == "none" else L.mask_level,
                      mask_low=L.mask_low, mask_high=L.mask_high,
                      staleness_decay=L.staleness_decay,
                      max_staleness=None if L.max_staleness < 0 else L.max_staleness,
                      policy_loss=L.policy_loss)


# ----------------------------------------------------------------------------- a GRPO phase

def grpo(r: Run, state, tx, pool, critic_state=None, ppo_saved: Optional[dict] = None,
         reference=None) -> tuple[step_setup.Setup, step_setup.Live]:
    """The GRPO step's compiled programs and fixed inputs, built once for the phase: the
    update for the micro-batch shapes (its token budget from the config or from device
    memory, shorter rows for a minibatch's last ones), the old / reference log-prob pass,
    the sequence-parallel prefill; with `rl.needs_ppo_pass` PPO's part (`lrl.ppo`: the
    critic, restored as `critic_state` or made from the policy, and the KL in the reward,
    its coefficient from `ppo_saved`). `reference`: the frozen reference a checkpoint kept
    (else the policy as the phase starts). -> (the setup, what its steps change: PPO's state,
    the shapes run so far)."""
    opts, task, mesh = r.opts, r.task, r.mesh
    rl_ = opts.rl
    # The update's programs, for the model config its rows need.
    loss_cfg = loss_config(opts)
    sizes = dict(row_len=rl_.row_len, max_tokens=rl_.max_tokens_per_micro,
                 longest=options_lib.longest_sample(opts),
                 unit=sp_prefill.length_unit(opts.model.attention, mesh.shape["seq"]))
    cfg = update_model_config(task.model_cfg, rl_, sizes)
    kw = dict(chunk=rl_.logprob_chunk, hidden=task.hidden, extra_keys=task.extra_keys)
    sink, why = grad_sink_lib.decide(opts.optim.grad_sink, remat=cfg.remat,
                                     offloaded=offload_lib.is_offload(tx))
    log.debug("layer gradients into the accumulator: %s (%s)", "on" if sink else "off", why)
    update = update_lib.make_update_programs(cfg, loss_cfg, tx, mesh, fused_head=rl_.fused_head,
                                             grad_sink=sink, **kw)
    shards = mesh_lib.data_shards(mesh)
    kl = bool(loss_cfg.kl_coef)
    # The frozen reference (the policy as this phase starts), made first: it takes memory.
    ref = kl or rl_.kl_in_reward
    ref_params = None
    if ref:
        ref_params = (reference if reference is not None
                      else jax.tree.map(lambda x: x.copy(), state.params))
    # So is PPO's critic (its params and optimizer state): the budget below is what the
    # actor, the reference and the critic leave, and a micro-batch fits both updates.
    p = _ppo(r, cfg, state, critic_state, ppo_saved, loss_cfg, kw)
    memory = budget_lib.device_memory(jax.local_devices()[0])
    need = _need_fn(task, rl_, mesh, update, state, p, sizes, shards, kl)
    # What a start with the same model, mesh, settings and device found (`lrl.compile_cache`):
    # its smallest micro-batch's need and its budget, without compiling either again.
    # (One process: processes with caches of their own could choose different budgets.)
    # What else lives beside the update: the reference and PPO's critic (its update is
    # compiled for the same shapes, so a run with one must not take a budget found without).
    critic = p.state if p is not None and p.critic is not None else None
    key = (_budget_key(r, cfg, loss_cfg, sizes, (state, critic), memory,
                       held=(ref, rl_.estimator, rl_.kl_in_reward))
           if memory is not None and jax.process_count() == 1 else None)
    found = compile_cache.load_budget(r.cache.path, key) if key else None
    # The rollout's pool takes its share of what the smallest micro-batch leaves; the update's
    # budget is then what is left.
    engine = decode = None   # with the pipeline, on the rollout mesh (`pipeline`)
    least = 0
    # The search's cost, for the note below and the first step's row.
    t0, counted, spent = time.time(), compiles.snapshot(), compiles.seconds()
    if memory is not None:
        least = found["least"] if found else need(*budget_lib.smallest_shape(**sizes))
    if r.rollout_mesh is None:
        # Offloaded (memory binds), the decode weights live only while a rollout runs.
        engine, decode = _engine(r, state.params, mesh, reserve=least,
                                 keep_decode=not offload_lib.is_offload(tx))
    budget, found = _token_budget(r, sizes, need, memory, key, found, least)
    searched = sum(compiles.since(counted).values())
    r.writer.with_next(compiles.top(compiles.seconds_since(spent), key="setup_compile_s"))
    lengths = budget_lib.row_lengths(budget.row_len, sizes["unit"])
    tail = (f"; a minibatch's last rows in rows of {'/'.join(map(str, lengths[1:]))} tokens"
            if len(lengths) > 1 else "")
    r.writer.note(f"update micro-batch: {budget.describe()}{tail}, at most "
                  f"{cfg.max_segments - 1} sequences a row"
                  + (" (found by an earlier start, kept in the compile cache)" if found else
                     f" (sizing the pool and it compiled {searched} programs, {time.time() - t0:.0f} s)"
                     if searched else ""))
    # The forward-only log-prob pass and the rollout's sequence-parallel prefill.
    logp_fn = None
    if rl_.old_logp == "trainer" or ref:
        logp_fn = update_lib.make_logprobs_fn(cfg, mesh, **kw)
    prefill = None
    if _sequence_parallel_prefill(r, mesh):
        prefill = sp_prefill.make_prefill(mesh, opts.rollout.sp_min_tokens)
    s = step_setup.Setup(
        rl=rl_, rollout=opts.rollout, seed=opts.seed, task=task, tokenizer=task.tokenizer,
        model_cfg=task.model_cfg, mesh=mesh, eos_ids=r.eos_ids, pool=pool, update=update,
        logprobs=logp_fn, shards=shards, row_len=budget.row_len,
        # A row of max_segments sequences would have one run more: its padding.
        rows_per_shard=budget.rows_per_shard, max_segments=cfg.max_segments - 1,
        buckets=lengths[1:],
        max_len=loss_cfg.max_len, prefill=prefill, engine=engine, decode=decode,
        # The frozen reference: the policy as this phase starts.
        ref_params=ref_params, ahead=_compile_ahead(
            need, packing.Cut(shards, budget.rows_per_shard, lengths), memory))
    return s, step_setup.Live(ppo=p)


def _compile_ahead(need, cut: packing.Cut, memory):
    """Every micro-batch shape of the update's `cut` (a minibatch's last rows too) compiled on
    a thread while the first rollout runs, where the device computes and the host has cores
    to spare; the search's shapes are compiled already (`need` keeps them). None on a CPU
    (`memory` None), whose cores the rollout needs."""
    if memory is None:
        return None
    return compiles.Background(lambda shape: need(*shape), cut.shapes(),
                               name="lrl-update-shapes")


# ----------------------------------------------------------------------------- its update

def with_update_runs(cfg, row_len: int, shared_group: int = 0):
    """`cfg` with the runs a row of `row_len` tokens may hold on cuDNN's packed attention
    (`flash.segments_for`); a shared group of `shared_group` responses (0: none), its prefix
    and the padding fit a row at least."""
    least = shared_group + 2 if shared_group else 2
    return cfg.replace(max_segments=flash_lib.segments_for(row_len, cfg.n_heads, cfg.head_dim,
                                                           least=least))


def update_model_config(cfg, rl_, sizes: dict):
    """The model config the update (and its log-prob pass) runs: `with_update_runs` for the
    rows' length, which is fixed before memory sets how many rows a micro-batch holds
    (`budget.smallest_shape`), and the groups `rl.shared_prompt` may share."""
    return with_update_runs(cfg, budget_lib.smallest_shape(**sizes)[1],
                            0 if rl_.shared_prompt == "off" else rl_.group_size)


def _ppo(r: Run, cfg, state, critic_state, saved, loss_cfg, kw) -> Optional[ppo_lib.PPO]:
    """PPO's part of the step (`lrl.ppo`), or None when the step has no such pass; the critic
    restored, or made now from the policy (or critic.hf_path)."""
    opts = r.opts
    if not opts.rl.needs_ppo_pass:
        return None
    if opts.rl.uses_critic and critic_state is None:
        if saved:
            raise ckpt_lib.CheckpointError(
                "the checkpoint resumed holds PPO's step state but no critic item: it was "
                f"saved by a run without rl.estimator={opts.rl.estimator!r}")
        critic_state = ppo_lib.init_critic(opts, cfg, r.mesh, state.params)
    p = ppo_lib.build(opts, cfg, r.mesh, critic_state, saved,
                      aggregation=loss_cfg.aggregation, hidden=kw["hidden"],
                      extra_keys=kw["extra_keys"])
    if p.critic is not None:
        r.writer.note(f"critic: the policy's decoder with a value head ("
                      f"{opts.critic.hf_path or 'from the policy'}), warm-up "
                      f"{opts.critic.warmup_steps} steps, {opts.critic.ppo_epochs} epoch(s)")
    return p


def _critic_spec(spec: dict) -> dict:
    """The critic update's micro-batch arrays, from the policy update's."""
    from lrl.rl import critic as critic_lib
    keys = critic_lib.ROW_KEYS + ("loss_mask", "prefix_ids")
    out = {k: v for k, v in spec.items() if k in keys}
    return {**out, "old_values": spec["loss_mask"], "returns": spec["loss_mask"]}


# ----------------------------------------------------------------------------- its token budget

def _need_fn(task, rl_, mesh, update, state, p, sizes: dict, shards: int, kl: bool):
    """(rows_per_shard, row_len) -> the bytes one micro-batch of that shape needs on a device
    beyond what is live (the update's, and PPO's critic's on the same rows), each shape
    compiled once whoever asks; `budget_lib.NO_FIT` where its compile ran out of memory."""
    def spec(rows_per_shard, row_len):
        return grpo_lib.micro_batch_spec(rl_, task, mesh, shards * rows_per_shard, row_len, kl)

    @functools.lru_cache(maxsize=None)   # compiled once: the same accumulator for every shape
    def apply_need():
        least = spec(*budget_lib.smallest_shape(**sizes))
        need_ = update_lib.apply_bytes(update, state, least, task.extra_spec())
        if p is not None and p.critic is not None:
            need_ = max(need_, update_lib.apply_bytes(p.critic, p.state, _critic_spec(least),
                                                      task.extra_spec()))
        return need_

    @functools.lru_cache(maxsize=None)   # each shape compiled once, whoever asks
    def need(rows_per_shard, row_len):
        # The accumulator lives through both programs; the optimizer step may need more.
        try:
            acc_need = update_lib.need_bytes(update, state.params,
                                             spec(rows_per_shard, row_len), task.extra_spec())
            if p is not None and p.critic is not None:   # the critic's update, same rows
                acc_need = max(acc_need, update_lib.need_bytes(
                    p.critic, p.state.params, _critic_spec(spec(rows_per_shard, row_len)),
                    task.extra_spec()))
        except jax.errors.JaxRuntimeError as e:
            if not budget_lib.out_of_memory(e):
                raise
            # XLA's GPU autotuner runs a candidate's kernels on buffers of their full size
            # while compiling, so a shape far past the device fails to compile at all.
            log.info("update micro-batch %d x %d: its compile ran out of memory (%s): does "
                     "not fit", rows_per_shard, row_len, str(e).splitlines()[0][:160])
            return budget_lib.NO_FIT
        return max(acc_need, apply_need())

    return need


def _token_budget(r: Run, sizes: dict, need, memory, key: Optional[str],
                  found: Optional[dict], least: int) -> tuple[budget_lib.Budget, bool]:
    """The update's micro-batch budget in what is free now (the engine's pool allocated): the
    one an earlier start found (`found`, kept in the compile cache under `key`) while it
    still fits, else resolved by compiling `need` at a few shapes (`budget_lib.resolve`) and
    kept. `memory`: the device's (None: no memory to read, the config's sizes alone).
    -> (the budget, whether it was the one found)."""
    free = None
    if memory is not None:   # what the update may add to what is live now
        limit, in_use = budget_lib.device_memory(jax.local_devices()[0])
        free = int(budget_lib.USABLE * limit) - in_use
    if found and found["need"] is not None and found["need"] > free:
        found = None   # less is free than when it was found: search again
    if found:
        return budget_lib.Budget(found["row_len"], found["rows_per_shard"], found["derived"],
                                 found["need"], free if found["need"] is not None else None), True
    mesh = r.mesh
    budget = budget_lib.resolve(**sizes, need_bytes=need if memory is not None else None,
                                available=free, floor_bytes=budget_lib.logits_floor(
                                    r.task.model_cfg.vocab_size, mesh.shape["seq"],
                                    mesh.shape["tensor"]))
    if key:
        compile_cache.save_budget(r.cache.path, key, dict(
            least=least, row_len=budget.row_len, rows_per_shard=budget.rows_per_shard,
            derived=budget.derived, need=budget.need_bytes))
    return budget, False


def _budget_key(r: Run, cfg, loss_cfg, sizes: dict, state, memory, held=()) -> str:
    """What the update's memory, and what is in use before it, depend on: the update's model
    config (remat, dtypes, runs a row), its loss, the row settings, the train states' arrays
    (the policy's, PPO's critic's) and what else is held (`held`: the reference, the estimator),
    the rollout pool's settings, the mesh, the device and its memory, jax."""
    o, device = r.opts, jax.local_devices()[0]
    return compile_cache.budget_key(
        model=cfg, model_options=o.model, loss=loss_cfg, sizes=sizes,
        update=(o.rl.logprob_chunk, o.rl.fused_head, o.rl.old_logp, o.rl.shared_prompt,
                o.optim.grad_sink,
                o.rl.group_size, o.rl.max_new_tokens, o.data.max_prompt_len),
        rollout=o.rollout, pipeline=o.pipeline, extra=(r.task.extra_keys, _name(r.task.hidden)),
        state=[(x.shape, x.dtype, str(x.sharding)) for x in jax.tree.leaves(state)],
        held=held, mesh=dict(r.mesh.shape),
        device=(device.platform, device.device_kind, memory[0], jax.process_count(),
                jax.device_count()),
        jax=(jax.__version__, getattr(jax.lib, "__version__", "")))


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


# ----------------------------------------------------------------------------- the engine

def _sequence_parallel_prefill(r: Run, mesh) -> bool:
    """Whether the rollout on `mesh` prefills long prompts sequence-parallel (ring or Ulysses
    over seq > 1, `lrl.rollout.sp_prefill`) rather than by the engine's own prefill."""
    return (r.opts.model.attention != "dense" and mesh.shape["seq"] > 1
            and r.rollout_mesh is None)


def _engine(r: Run, params, mesh, reserve: int = 0, keep_decode: bool = True):
    """The rollout engine for the whole run on `mesh` (`params` on it), sized from the
    options: slots, the longest prompt and completion, a pool of `rollout.pool_tokens` or
    `rollout.pool_fraction` of the memory free now beyond `reserve` bytes (never more than
    every slot's longest sample needs), with its pool allocated now; and the decode-layout
    weights, relaid in place each step (`keep_decode`) or laid out for each rollout and
    dropped before the update (`lrl.rollout.weights.DecodeWeights`), which then reserves
    the larger of the two, not both."""
    opts, cfg = r.opts, r.task.model_cfg
    ro, rl_ = opts.rollout, opts.rl
    prompt, new = options_lib.longest_prompt(opts), rl_.max_new_tokens
    ps = ro.page_size
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    decode = weights_lib.DecodeWeights(cfg, mesh, keep=keep_decode)
    decode.refresh(params)   # allocated before the pool is sized
    # Every slot's longest sample, and a prefix of the longest prompt beside each.
    full = ro.max_slots * (pages_for(prompt + new - 1, ps) + pages_for(prompt, ps)) + 1
    if ro.pool_tokens:
        num_pages = pages_lib.num_pages_for_tokens(ro.pool_tokens, ps)
    elif budget_lib.device_memory(device) is not None:
        tensor = mesh.shape["tensor"]
        shards = tensor if cfg.n_kv_heads % tensor == 0 else 1
        limit, in_use = budget_lib.device_memory(device)
        free = pool_free(int(budget_lib.USABLE * limit), in_use, reserve,
                         decode.device_bytes(device), keep_decode)
        page_bytes = pages_lib.kv_bytes_per_token(cfg) * ps // shards
        num_pages = min(full, int(free * ro.pool_fraction) // page_bytes)
        if num_pages < pages_for(prompt + new - 1, ps) + pages_for(prompt, ps) + 1:
            raise errors.UserError(
                f"rollout.pool_fraction={ro.pool_fraction} of the {free / 2**30:.1f} GiB the "
                f"update leaves holds {num_pages} pages of {ps} tokens, less than one sample of "
                f"{prompt} + {new} tokens (of the {budget_lib.USABLE * limit / 2**30:.1f} GiB "
                f"planned on, {in_use / 2**30:.1f} are in use: the weights and their decode "
                f"layout; the update reserves {reserve / 2**30:.1f}: its gradient accumulator "
                "and the larger of its smallest micro-batch and its optimizer step)",
                "config key rollout.pool_fraction",
                "raise it, set rollout.pool_tokens, or lower rl.max_tokens_per_micro")
    else:
        num_pages = full
    ecfg = rollout_lib.engine_config(
        cfg, max_prompt_len=prompt, max_new_tokens=new, max_slots=ro.max_slots,
        num_pages=num_pages, page_size=ps, prefill_tokens=ro.prefill_tokens,
        resumed_prompts=ro.partial, eos_ids=r.eos_ids,
        sampling=rollout_lib.SamplingParams(rl_.temperature, rl_.top_k, rl_.top_p),
        narrow_widths=None if ro.narrow_decode else (),
        # Long prompts in one whole-prompt call, unless sp_prefill takes them.
        whole_prefill=not _sequence_parallel_prefill(r, mesh))
    engine = rollout_lib.Engine(cfg, ecfg, mesh)
    state = engine.compile_prefill(decode.params, engine.take_state(),
                                   multimodal=r.task.multimodal)
    engine.keep_state(engine.compile_decode(decode.params, state,
                                            num_steps=rollout_lib.STEPS_PER_CALL))
    tail = (f", tail decode calls of {'/'.join(map(str, ecfg.narrow_widths))} rows"
            if ecfg.narrow_widths else "")
    narrow = "".join(f" (or {r} x {c})" for r, c in (
        (ecfg.prefill_narrow_rows, ecfg.prefill_chunk), (1, ecfg.prefill_short_chunk)) if r * c)
    whole = (f", longer prompts whole in calls of 1 x {'/'.join(map(str, ecfg.prefill_lengths))}"
             if ecfg.prefill_lengths else "")
    r.writer.note(f"rollout engine: {ro.max_slots} slots, a pool of {num_pages * ps} tokens "
                  f"({num_pages} pages of {ps}), prefill calls of {ecfg.rows_per_prefill} x "
                  f"{ecfg.prefill_chunk} tokens{narrow}{whole}{tail}"
                  + ("" if keep_decode else "; its decode-layout weights made for each rollout "
                     "and dropped before the update"))
    decode.release()   # without keep_decode: the update's budget is sized without them
    return engine, decode


def pool_free(usable: int, in_use: int, reserve: int, decode_bytes: int, keep_decode: bool):
    """Bytes the rollout's pool takes its share of: what is free now (`in_use` counts the
    decode weights, `decode_bytes`) beyond the update's `reserve`. Decode weights dropped
    before each update (not `keep_decode`) never live beside it: the two need the larger of
    them, not their sum."""
    free = usable - in_use - reserve
    return free if keep_decode else free + min(decode_bytes, reserve)


# ----------------------------------------------------------------------------- the pipeline

def pipeline(r: Run, s: step_setup.Setup, state) -> pipeline_lib.Pipeline:
    """The one-step-off pipeline's rollout half: the weights' handover to the rollout mesh,
    the engine there (its pool from the rollout devices' memory), and the step's setup with
    them (no sequence-parallel prefill: the rollout mesh has no `seq` axis)."""
    hand = pipeline_lib.handover(state.params, r.mesh, r.rollout_mesh)
    engine, decode = _engine(r, hand(state.params), r.rollout_mesh)
    r.writer.note(f"one-step-off pipeline: train on {mesh_lib.describe(r.mesh)}, sample on "
                  f"{mesh_lib.describe(r.rollout_mesh)}")
    roll = dataclasses.replace(s, mesh=r.rollout_mesh, engine=engine, decode=decode,
                               prefill=None)
    return pipeline_lib.Pipeline(s, roll, hand)
