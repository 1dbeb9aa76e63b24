"""What PPO adds to a step's learning half (`lrl.grpo.learn`), used when `rl.needs_ppo_pass`:
a critic's values and GAE (`rl.estimator="gae"`), and the KL to the reference in the reward
(`rl.kl_in_reward`, with any estimator).

Advantages then come after packing, not before: the samples are packed with zero advantages,
each row carrying `score` (the sample's reward on its last response token, a token value of
`lrl.data.packing`) and `sample_id` (its index + 1 among the samples this process packed);
the one forward pass over the micro-batches that takes the old and reference log-probs also
takes the critic's old values (`lrl.grpo.old_and_ref_logps`), and from those rows

- gae: token rewards = score - beta * kl(old || ref) per token (with the KL in the reward),
  GAE within each packed sequence (`lrl.rl.gae.gae_packed`), the raw advantages whitened over
  the whole step's response tokens (statistics summed over micro-batches and processes),
  returns = raw advantages + old values; written into the rows as `advantages` and `returns`;
- an outcome estimator (grpo, rloo, ...) with the KL in the reward: each sample's score
  becomes R - beta * sum_t kl_t (verl's GRPO reads the sum of the penalised token rewards),
  the estimator runs on those, and each sample's advantage is written over its tokens.

Then the critic takes `critic.ppo_epochs` passes over the step's minibatches (its optimizer
steps), and the actor its usual updates unless the step is one of `critic.warmup_steps`.

`PPO` is the state this adds to a run, carried from step to step beside the policy's
`TrainState`: the critic's programs and train state, the KL coefficient and the steps learnt;
the checkpoint keeps the critic's state as its `critic` item and the rest in the data state
(`to_state` / `from_state`).

B batch rows · T positions.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from lrl import distributed
from lrl import mesh as mesh_lib
from lrl.rl import critic as critic_lib
from lrl.rl.train import TrainState

# Row arrays only this pass reads (the actor's update is compiled without them).
PASS_KEYS = ("score", "sample_id", "old_values", "returns")


@dataclasses.dataclass
class PPO:
    """The run's PPO state beside the policy's (replaced in place as steps learn)."""
    rl: object                                   # options.RLOptions
    warmup_steps: int                            # critic.warmup_steps
    ppo_epochs: int                              # critic.ppo_epochs
    critic: Optional[critic_lib.CriticPrograms]  # None: no critic (KL in the reward only)
    state: Optional[TrainState]                  # the critic's train state
    kl_coef: float                               # beta of the KL in the reward
    steps: int = 0                               # steps learnt so far
    token_pass: object = None                    # jitted, per micro-batch (`build`)
    whiten: object = None
    kl_sums: object = None
    spread: object = None

    def to_state(self) -> dict:
        return {"kl_coef": float(self.kl_coef), "steps": int(self.steps)}

    @property
    def actor_learns(self) -> bool:
        """Past the critic's warm-up (verl: `critic_warmup <= global_steps`)."""
        return self.critic is None or self.steps >= self.warmup_steps


def build(opts, model_cfg, mesh, critic_state=None, saved: Optional[dict] = None, *,
          aggregation: str, hidden=None, extra_keys: tuple = ()) -> PPO:
    """The run's PPO part: the critic's programs on `mesh` (`model_cfg`: the update's) and its
    state (restored, or None to be made by `init_critic`), and the KL coefficient and steps
    a checkpoint's data state saved (`saved`, or a fresh start)."""
    rl, c = opts.rl, opts.critic
    saved = saved or {}
    critic = None
    if rl.uses_critic:
        from lrl import models
        ccfg = critic_lib.critic_config(model_cfg, c.remat)
        critic = critic_lib.make_programs(
            ccfg, critic_optimizer(opts), mesh, cliprange_value=c.cliprange_value,
            aggregation=aggregation, hidden=hidden or models.batch_hidden_states,
            extra_keys=extra_keys)
    p = PPO(rl, c.warmup_steps, c.ppo_epochs, critic, critic_state,
            float(saved.get("kl_coef", rl.kl_ctrl.coef)), int(saved.get("steps", 0)))
    bs = mesh_lib.batch_sharding(mesh, 2) if mesh is not None else None
    rep = mesh_lib.replicated(mesh) if mesh is not None else None
    def sh(*x):
        return {} if mesh is None else dict(out_shardings=x if len(x) > 1 else x[0])
    kl = dict(estimator=rl.kl_ctrl.estimator, kl_on=rl.kl_in_reward)
    p.token_pass = jax.jit(functools.partial(_token_pass, gamma=rl.gamma, lam=rl.lam, **kl),
                           **sh(bs, bs, rep, rep))
    p.whiten = jax.jit(_whiten, **sh(bs, rep))
    p.kl_sums = jax.jit(functools.partial(_kl_sums, estimator=rl.kl_ctrl.estimator,
                                          n=rl.prompts_per_step * rl.group_size),
                        **sh(rep, rep))
    p.spread = jax.jit(_spread, **sh(bs))
    return p


def critic_optimizer(opts):
    from lrl.rl.optim import for_phase
    o = opts.critic.optim
    return for_phase(o, opts.rl_steps * opts.critic.ppo_epochs * opts.rl.minibatches)


def abstract_critic(opts, model_cfg, mesh) -> TrainState:
    """The critic's train state as a restore reads it."""
    ccfg = critic_lib.critic_config(model_cfg, opts.critic.remat)
    return critic_lib.abstract_state(ccfg, critic_optimizer(opts), mesh)


def init_critic(opts, model_cfg, mesh, policy_params) -> TrainState:
    """A fresh critic: from `critic.hf_path` (a HF score model's decoder and head), else the
    policy's parameters with the head at zero or `critic.head_init_std`."""
    c = opts.critic
    ccfg = critic_lib.critic_config(model_cfg, c.remat)
    if c.hf_path:
        params = _load_hf_critic(c.hf_path, ccfg, mesh)
    else:
        params = critic_lib.params_from_policy(ccfg, policy_params, c.head_init_std,
                                               seed=opts.seed)
    return critic_on(opts, model_cfg, mesh, params)


def critic_on(opts, model_cfg, mesh, params) -> TrainState:
    """The critic's train state on `params`, its optimizer fresh: a new critic's, or one
    restored from a checkpoint that kept the weights only."""
    ccfg = critic_lib.critic_config(model_cfg, opts.critic.remat)
    return critic_lib.init_state(ccfg, params, critic_optimizer(opts), mesh)


def _load_hf_critic(path: str, ccfg, mesh):
    """A HF *ForTokenClassification (one label) or *ForSequenceClassification checkpoint ->
    the critic's parameters (`lrl.models.score.load_hf_score`): its decoder, and its `score`
    weight as the head. Its shapes must be the policy's (the critic runs the policy's
    config)."""
    from lrl.models import score
    _, params, head_DL, meta = score.load_hf_score(path, dtype=ccfg.param_dtype, mesh=mesh)
    if tuple(head_DL.shape) != (ccfg.d_model, 1):
        raise ValueError(f"critic.hf_path={path!r}: its score head is {tuple(head_DL.shape)} "
                         f"({meta.get('num_labels')} labels), the critic needs one label of "
                         f"the policy's width: [{ccfg.d_model}, 1]")
    decoder = score.decoder_params(params)
    want = jax.tree.map(lambda x: x.shape, critic_lib.abstract_params(ccfg)["decoder"])
    got = jax.tree.map(lambda x: x.shape, decoder)
    if want != got:
        raise ValueError(f"critic.hf_path={path!r}: its decoder's shapes differ from the "
                         "policy's (model.*): the critic runs the policy's architecture")
    bias = meta.get("bias_L")
    return {"decoder": decoder, "score_DL": head_DL,
            "score_L": jnp.asarray(np.zeros(1) if bias is None else np.asarray(bias).reshape(1),
                                   ccfg.param_dtype)}


# ----------------------------------------------------------------------------- packing

def pack_values(samples: np.ndarray, rewards: np.ndarray, completions: list,
                token_values: dict, seq_values: dict) -> None:
    """Adds the pass's row arrays to `pack`'s values: each sample's reward on its last
    response token (`score`) and its index + 1 among `samples`' positions (`sample_id`)."""
    score = []
    for i in samples:
        x = np.zeros(len(completions[i]), np.float32)
        if len(x):
            x[-1] = rewards[i]
        score.append(x)
    token_values["score"] = score
    seq_values["sample_id"] = np.asarray(samples, np.float32) + 1.0


# ----------------------------------------------------------------------------- device halves

def _mask_keys(mb):
    return {k: mb[k] for k in ("segment_ids", "loss_mask")}


def _sid_keys(mb):
    return {k: mb[k] for k in ("segment_ids", "loss_mask", "sample_id")}


def _kl_keys(mb):
    return {k: mb[k] for k in ("segment_ids", "loss_mask", "sample_id", "old_logp", "ref_logp")}


def _mask(mb):
    return jnp.where(mb["segment_ids"] > 0, (mb["loss_mask"] > 0).astype(jnp.float32), 0.0)


def _token_pass(mb, beta, *, gamma, lam, estimator, kl_on):
    """GAE's first half on one micro-batch -> (raw advantages, returns, whitening sums, KL
    sums)."""
    from lrl.rl.gae import gae_packed, whiten_stats
    from lrl.rl.kl import kl_penalty
    m = _mask(mb)
    r = mb["score"]
    sums = {"kl_seq_mean_sum": jnp.zeros((), jnp.float32),
            "kl_sequences": jnp.zeros((), jnp.float32)}
    if kl_on:
        r, km = kl_penalty(r, mb["old_logp"], mb["ref_logp"], m, beta, estimator,
                              mb["segment_ids"])
        sums = {k: km[k] for k in sums}
    raw, ret = gae_packed(r, mb["old_values"], m, mb["segment_ids"], gamma, lam)
    return raw, ret, whiten_stats(raw, m), sums


def _whiten(raw, mb, stats):
    """-> (whitened advantages, the sum of their absolute values over the response)."""
    from lrl.rl.gae import whiten
    m = _mask(mb)
    adv = whiten(raw, m, stats)
    return adv, jnp.sum(jnp.abs(adv) * m)


def _kl_sums(mb, *, estimator, n):
    """Each sample's sum of per-token KL(old || ref) [n + 1] (index 0: padding), and this
    micro-batch's (sum over sequences of their mean token KL, sequences)."""
    from lrl.rl.kl import token_kl
    m = _mask(mb)
    kl_BT = token_kl(mb["old_logp"], mb["ref_logp"], m, estimator)
    sid = mb["sample_id"].astype(jnp.int32)
    per = jnp.zeros((n + 1,), jnp.float32).at[sid].add(kl_BT)
    tok = jnp.zeros((n + 1,), jnp.float32).at[sid].add(m)
    mean = jnp.where(tok[1:] > 0, per[1:] / jnp.maximum(tok[1:], 1.0), 0.0)
    return per, jnp.stack([mean.sum(), (tok[1:] > 0).sum().astype(jnp.float32)])


def _spread(adv_N, mb):
    """Each sample's advantage over its response tokens (0 elsewhere)."""
    sid = mb["sample_id"].astype(jnp.int32)
    on = _mask(mb) > 0
    return jnp.where(on, jnp.concatenate([jnp.zeros((1,), jnp.float32), adv_N])[sid], 0.0)


# ----------------------------------------------------------------------------- host halves

def _allsum(x):
    """Sums of this process's parts with every other process's."""
    if jax.process_count() == 1:
        return x
    return sum(np.asarray(p) for p in distributed.allgather_objects(np.asarray(x)))


def old_values(p: PPO, mb: dict, extra) -> dict:
    """`mb` with the critic's values (before this step's updates), when there is a critic."""
    if p.critic is None:
        return mb
    return {**mb, "old_values": critic_lib.old_values(p.critic, p.state.params, mb, extra)}


def gae_advantages(p: PPO, batches: list) -> tuple[list, dict]:
    """The rows' advantages and returns by GAE on their token rewards and old values,
    whitened over the step's response tokens -> (batches, metrics)."""
    beta = jnp.float32(p.kl_coef)
    keys = ("score", "old_values", "segment_ids", "loss_mask") + (
        ("old_logp", "ref_logp") if p.rl.kl_in_reward else ())
    parts = [[p.token_pass({k: mb[k] for k in keys}, beta) for mb in b.micro] for b in batches]
    stats = [st for b in parts for (_, _, st, _) in b]
    total = _allsum(np.asarray(jax.device_get([list(s) for s in stats]), np.float64).sum(0))
    kls = _allsum(np.asarray(jax.device_get(
        [[k["kl_seq_mean_sum"], k["kl_sequences"]] for b in parts for (*_, k) in b]),
        np.float64).sum(0))
    from lrl.rl.gae import WhitenStats
    whole = WhitenStats(*(jnp.float32(x) for x in total))
    out, abs_sums = [], []
    for b, bp in zip(batches, parts):
        micro = []
        for mb, (raw, ret, _, _) in zip(b.micro, bp):
            adv, abs_sum = p.whiten(raw, _mask_keys(mb), whole)
            micro.append({**mb, "advantages": adv, "returns": ret})
            abs_sums.append(abs_sum)
        out.append(dataclasses.replace(b, micro=micro))
    n = max(total[2], 1.0)
    mean = total[0] / n
    m = {"advantage/raw_mean": float(mean),
         "advantage/raw_std": float(np.sqrt(max(total[1] / n - mean * mean, 0.0))),
         # the whitened advantages' mean size over the response tokens (0: no gradient)
         "advantage/abs_mean": float(_allsum(np.sum(jax.device_get(abs_sums))) / n),
         "advantage/tokens": float(total[2])}
    return out, {**m, **_kl_metrics(p, kls)}


def _kl_metrics(p: PPO, kls) -> dict:
    if not p.rl.kl_in_reward:
        return {}
    current = float(kls[0] / max(kls[1], 1.0))
    return {"kl_in_reward/kl": current, "kl_in_reward/coef": p.kl_coef,
            "kl_in_reward/sequences": float(kls[1])}


def sample_kl_sums(p: PPO, batches: list, n_local: int) -> tuple[np.ndarray, dict]:
    """Each of this process's `n_local` samples' sum of token KL(old || ref), and the KL
    metrics, from the rows (the outcome estimators' form)."""
    per, kls = None, np.zeros(2)
    for b in batches:
        for mb in b.micro:
            s, k = jax.device_get(p.kl_sums(_kl_keys(mb)))
            per = s if per is None else per + s
            kls = kls + np.asarray(k, np.float64)
    return np.asarray(per[1:n_local + 1], np.float32), _kl_metrics(p, _allsum(kls))


def all_samples(local: np.ndarray) -> np.ndarray:
    """Every process's per-sample values in process order (`lrl.grpo.process_share`'s)."""
    if jax.process_count() == 1:
        return local
    return np.concatenate([np.asarray(x) for x in distributed.allgather_objects(local)])


def outcome_advantages(p: PPO, batches: list, adv_N: np.ndarray) -> list:
    """The rows with each sample's advantage (`adv_N` over this process's samples, in the
    order `sample_id` counts) over its response tokens."""
    n = p.rl.prompts_per_step * p.rl.group_size
    vec = jnp.asarray(np.pad(np.asarray(adv_N, np.float32), (0, n - len(adv_N))))
    return [dataclasses.replace(b, micro=[{**mb, "advantages": p.spread(vec, _sid_keys(mb))}
                                          for mb in b.micro]) for b in batches]


def critic_updates(p: PPO, batches: list) -> dict:
    """`critic.ppo_epochs` passes of the critic over the step's minibatches (one optimizer
    step each) -> the last one's metrics, under critic/."""
    t0 = time.time()
    metrics = None
    for _ in range(p.ppo_epochs):
        for b in batches:
            p.state, metrics = critic_lib.run_update(p.critic, p.state, b.micro, b.denoms,
                                                     b.extra)
    metrics = jax.device_get(metrics)
    names = {"vf_loss": "vf_loss", "vf_clipfrac": "vf_clipfrac", "vpred_mean": "values_mean",
             "returns_mean": "returns_mean", "grad_norm": "grad_norm",
             "learning_rate": "lr"}
    out = {f"critic/{v}": float(metrics[k]) for k, v in names.items() if k in metrics}
    out["time/critic_s"] = time.time() - t0
    return out


def end_step(p: PPO, metrics: dict, sequences: int) -> None:
    """After a step: its count, and the KL coefficient for the next (the adaptive controller
    reads this step's KL over its `sequences` samples, as verl's)."""
    from lrl.rl.kl import update_kl_coef
    p.steps += 1
    if p.rl.kl_in_reward and "kl_in_reward/kl" in metrics:
        k = p.rl.kl_ctrl
        p.kl_coef = update_kl_coef(p.kl_coef, metrics["kl_in_reward/kl"], sequences,
                                   control=k.type, target_kl=k.target_kl, horizon=k.horizon)


def warm(p: PPO, params, batches: list) -> None:
    """Runs the pass's programs once on each micro-batch (empty rows of a shape the step has
    not run yet): their shapes compile in the run's first step."""
    if p.critic is not None:
        batches, _ = gae_advantages(p, batches)
        for b in batches:
            critic_lib.compile_shapes(p.critic, p.state.params, b.micro, b.denoms, b.extra)
    elif p.rl.kl_in_reward:
        n = p.rl.prompts_per_step * p.rl.group_size
        for b in batches:
            for mb in b.micro:
                jax.block_until_ready(p.kl_sums(_kl_keys(mb)))
                jax.block_until_ready(p.spread(jnp.zeros((n,), jnp.float32), _sid_keys(mb)))
    del params
