"""Clipped policy-gradient objectives of the GRPO family (PPO clip, clip-higher, dual clip,
GSPO sequence ratios), KL to a reference, entropy bonus, and the rollout correction of
lrl.rl.correction (truncated IS at token, sequence or geometric level, masked IS, a staleness
weight).

The core works on packed rows: several sequences per row, told apart by segment ids
(0 = padding, 1, 2, ... = sequences of that row), with one advantage per token. Every
aggregation is written as a per-token weight whose denominators (masked tokens, sequences,
B·max_len) are computed ONCE over the whole minibatch by `loss_denominators`; a micro-batch
then contributes sum(weight · term), so summing the contributions of micro-batches and data
shards gives exactly the one-big-batch loss (and gradient). `policy_loss` is the plain
[B, T] form (one sequence per row, one advantage per row) written over the packed core.
The per-token policy term is PPO clip (`ppo_clip`) unless `LossConfig.policy_loss` names
another registered one (`lrl.rl.registry`); the rest of the objective stays as here.

Dimension letters: B batch rows · T positions.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lrl.rl import correction, registry

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
# Log-ratios are clamped before exp so one wild token cannot overflow (verl does the same).
# The same clamp bounds every log-ratio that enters the loss: the PPO and TIS ratios, GSPO's
# sequence log-ratio (verl caps that one at +10 only, so the two differ past +10 and below
# -20), and the KL's ref - logp, which makes k1 lie in [-20, 20] and k2 in [0, 200] (verl
# leaves both unbounded; they agree while |ref - logp| <= 20).
_MAX_LOG_RATIO = 20.0
# verl's cap of the k3 ("low_var_kl") estimate: e^d - d - 1 reaches it at d = ref - logp =
# 2.611 (and at -11.0), and a token far from the reference would otherwise dominate the loss
# (e^20 at the clamp). Past the cap the token's KL term has no gradient, as under torch.clamp.
_MAX_K3 = 10.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Options of the objective; see `policy_loss` for their meaning."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: str = "token"
    aggregation: str = "token_mean"
    max_len: int | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    tis_level: str = "token"
    mask_level: str | None = None
    mask_low: float = 0.5
    mask_high: float = 2.0
    staleness_decay: float = 1.0
    max_staleness: int | None = None
    policy_loss: str = "ppo_clip"   # the per-token policy term (`lrl.rl.registry`)

    @property
    def corrects_rollout(self) -> bool:
        """A term compares the trainer's old log-probs with the sampler's (rollout_logp)."""
        return self.tis_cap is not None or self.mask_level is not None

    @property
    def weighs_staleness(self) -> bool:
        """Samples are weighted by their age (the batch's sample_age)."""
        return self.staleness_decay != 1.0 or self.max_staleness is not None

    @property
    def corrects_sequences(self) -> bool:
        """A correction reads a whole sequence's ratio (not only each token's)."""
        return ((self.tis_cap is not None and self.tis_level != "token")
                or self.mask_level in ("sequence", "geometric"))

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss: unknown aggregation {self.aggregation!r}; valid: {AGGREGATIONS}")
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"loss: unknown ratio_level {self.ratio_level!r}; valid: {RATIO_LEVELS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"loss: unknown kl_estimator {self.kl_estimator!r}; valid: {KL_ESTIMATORS}")
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            raise ValueError(f"loss: need 0 <= clip_low < 1 and clip_high >= 0, got "
                             f"clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"loss: dual_clip must be > 1 (verl uses 3), got {self.dual_clip}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"loss: tis_cap must be positive, got {self.tis_cap}")
        if self.tis_level not in correction.LEVELS:
            raise ValueError(f"loss: unknown tis_level {self.tis_level!r}; valid: "
                             f"{correction.LEVELS}")
        if self.mask_level is not None and self.mask_level not in correction.LEVELS:
            raise ValueError(f"loss: unknown mask_level {self.mask_level!r}; valid: None or "
                             f"{correction.LEVELS}")
        if not 0.0 < self.mask_low <= 1.0 <= self.mask_high:
            # a band without 1 would drop the tokens sampler and trainer agree on
            raise ValueError(f"loss: need 0 < mask_low <= 1 <= mask_high, got mask_low="
                             f"{self.mask_low}, mask_high={self.mask_high}")
        if not 0.0 < self.staleness_decay <= 1.0:
            raise ValueError(f"loss: staleness_decay must be in (0, 1], got "
                             f"{self.staleness_decay}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"loss: max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_len is not None and self.max_len <= 0:
            raise ValueError(f"loss: max_len must be positive, got {self.max_len}")
        registry.policy_loss_fn(self.policy_loss, key="loss: policy_loss")


class Denominators(NamedTuple):
    """Normalisers of a whole minibatch (all micro-batches, all data shards)."""
    tokens: jax.Array     # masked (trained) tokens
    sequences: jax.Array  # sequences with at least one masked token
    sum_norm: jax.Array   # (number of sequences) · max_len, for seq_mean_token_sum_norm


def _segment_slots(segment_ids_BT):
    """A flat slot per (row, segment id) and the number of slots: ids lie in [0, T]."""
    b, t = segment_ids_BT.shape
    return segment_ids_BT + (t + 1) * jnp.arange(b, dtype=segment_ids_BT.dtype)[:, None], b * (t + 1)


def _segment_sum(x_BT, slots_BT, n):
    return jax.ops.segment_sum(x_BT.reshape(-1), slots_BT.reshape(-1), num_segments=n)


def _float_mask(mask_BT, segment_ids_BT):
    # Padding (segment 0) never trains, whatever the mask says.
    return jnp.where(segment_ids_BT > 0, mask_BT.astype(jnp.float32), 0.0)


def loss_denominators(mask_BT, segment_ids_BT, max_len: int | None = None) -> Denominators:
    """Denominators from the loss mask of the WHOLE minibatch (call once, outside the
    micro-batch loop). `max_len` is only needed by seq_mean_token_sum_norm."""
    mask_BT = _float_mask(mask_BT, segment_ids_BT)
    slots_BT, n = _segment_slots(segment_ids_BT)
    seq_tokens = _segment_sum(mask_BT, slots_BT, n)
    sequences = jnp.sum(seq_tokens > 0).astype(jnp.float32)
    sum_norm = sequences * (max_len if max_len is not None else jnp.nan)
    return Denominators(tokens=mask_BT.sum(), sequences=sequences, sum_norm=sum_norm)


def token_weights(mask_BT, segment_ids_BT, denoms: Denominators, aggregation: str):
    """Per-token weights w such that the aggregated value of a per-token x is sum(w · x)."""
    mask_BT = _float_mask(mask_BT, segment_ids_BT)
    if aggregation == "token_mean":
        return mask_BT / jnp.maximum(denoms.tokens, 1.0)
    if aggregation == "seq_mean_token_mean":
        slots_BT, n = _segment_slots(segment_ids_BT)
        seq_tokens_BT = _segment_sum(mask_BT, slots_BT, n)[slots_BT]
        return mask_BT / jnp.maximum(seq_tokens_BT, 1.0) / jnp.maximum(denoms.sequences, 1.0)
    if aggregation == "seq_mean_token_sum_norm":
        return mask_BT / denoms.sum_norm
    raise ValueError(f"loss: unknown aggregation {aggregation!r}; valid: {AGGREGATIONS}")


def _kl(logp_BT, ref_logp_BT, estimator: str):
    d_BT = jnp.clip(ref_logp_BT - logp_BT, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # log(ref / pi)
    if estimator == "k1":
        return -d_BT
    if estimator == "k2":
        return 0.5 * d_BT ** 2
    return jnp.minimum(jnp.exp(d_BT) - d_BT - 1.0, _MAX_K3)


def _check_terms(cfg: LossConfig, ref_logp, rollout_logp, age=None):
    if cfg.corrects_rollout and rollout_logp is None:
        raise ValueError("loss: tis_cap / mask_level is set but rollout_logp_BT (the "
                         "sampler's log-probs) was not given")
    if cfg.weighs_staleness and age is None:
        raise ValueError("loss: staleness_decay / max_staleness is set but age_BT (each "
                         "token's sample age) was not given")
    if cfg.kl_coef != 0.0 and ref_logp is None:
        raise ValueError(f"loss: kl_coef={cfg.kl_coef} needs ref_logp_BT")
    if cfg.aggregation == "seq_mean_token_sum_norm" and cfg.max_len is None:
        raise ValueError("loss: aggregation seq_mean_token_sum_norm needs max_len")


def _clipped_pg(log_ratio, adv, cfg: LossConfig):
    """Per-token clipped policy-gradient term -> (term, ratio), elementwise."""
    ratio = jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
    if cfg.dual_clip is not None:
        pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * cfg.dual_clip), pg)
    return pg, ratio


@registry.register_policy_loss("ppo_clip")
def ppo_clip(logp_BT, old_logp_BT, adv_BT, mask_BT, cfg: LossConfig):
    """The default policy term: PPO's clipped surrogate with clip-higher and dual clip
    (`policy_loss` documents it), as a registered policy loss."""
    pg_BT, _ = _clipped_pg(jnp.where(mask_BT, logp_BT - old_logp_BT, 0.0), adv_BT, cfg)
    return pg_BT, {}


def _pg_term(log_ratio, logp, adv, on, cfg: LossConfig):
    """Each token's policy term -> (term, ratio, per-token metrics): PPO clip unless
    `cfg.policy_loss` names another (`lrl.rl.registry`), which is handed old log-probs
    without gradient such that logp - old is `log_ratio` (GSPO's sequence ratio too)."""
    if cfg.policy_loss == "ppo_clip":
        pg, ratio = _clipped_pg(log_ratio, adv, cfg)
        return pg, ratio, {}
    fn = registry.policy_loss_fn(cfg.policy_loss, key="loss: policy_loss")
    pg, metrics = fn(logp, jax.lax.stop_gradient(logp - log_ratio), adv, on, cfg)
    ratio = jnp.exp(jnp.clip(jax.lax.stop_gradient(log_ratio), -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return pg, ratio, metrics


def _correction(cfg: LossConfig, on, segment_ids, old_logp, rollout_logp, age):
    """-> (IS weight, keep mask, staleness weight), each 1 where off, without gradient: the
    policy term of a token is multiplied by IS x staleness, and its whole term by keep. The
    sampler drew the tokens and the trainer's old log-probs judge them, so the ratio is
    old / rollout (verl's rollout correction). `rollout_logp` None: no IS weight or mask;
    `age` None: no staleness weight; `segment_ids` None: token level only."""
    ones = jnp.ones(on.shape, jnp.float32)
    w_is, keep, stale = ones, ones, ones
    if cfg.corrects_rollout and rollout_logp is not None:
        log_ratio = jnp.where(on, old_logp - rollout_logp, 0.0)
        if cfg.tis_cap is not None:
            w_is = correction.is_weight(log_ratio, on, segment_ids, level=cfg.tis_level,
                                        cap=cfg.tis_cap)
        if cfg.mask_level is not None:
            keep = correction.keep_mask(log_ratio, on, segment_ids, level=cfg.mask_level,
                                        low=cfg.mask_low, high=cfg.mask_high)
    if cfg.weighs_staleness and age is not None:
        stale = jnp.where(on, correction.staleness_weight(
            age, decay=cfg.staleness_decay, max_age=cfg.max_staleness), 1.0)
    return w_is, keep, stale


def packed_policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, segment_ids_BT,
                       denoms: Denominators, cfg: LossConfig, *, ref_logp_BT=None,
                       rollout_logp_BT=None, age_BT=None, entropy_BT=None):
    """Loss contribution of one micro-batch of packed rows, and its summable metrics.

    All per-token inputs are [B, T]; `denoms` come from `loss_denominators` over the whole
    minibatch. The returned loss and the metrics (see `combine_metrics`) add up over
    micro-batches to the values of the whole minibatch. `rollout_logp_BT` (the sampler's
    log-probs) serves the rollout correction, `age_BT` (each token's sample age in policy
    versions) the staleness weight; see `policy_loss`.
    """
    arrays = dict(logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv_BT=adv_BT, mask_BT=mask_BT,
                  segment_ids_BT=segment_ids_BT, ref_logp_BT=ref_logp_BT,
                  rollout_logp_BT=rollout_logp_BT, age_BT=age_BT, entropy_BT=entropy_BT)
    for name, a in arrays.items():
        if a is not None and a.shape != logp_BT.shape:
            raise ValueError(f"loss: {name} has shape {a.shape}, expected {logp_BT.shape}")
    _check_terms(cfg, ref_logp_BT, rollout_logp_BT, age_BT)
    if cfg.entropy_coef != 0.0 and entropy_BT is None:
        raise ValueError(f"loss: entropy_coef={cfg.entropy_coef} needs entropy_BT")

    m_BT = _float_mask(mask_BT, segment_ids_BT)
    on_BT = m_BT > 0
    logp_BT = logp_BT.astype(jnp.float32)
    adv_BT = adv_BT.astype(jnp.float32)
    old_logp_BT = old_logp_BT.astype(jnp.float32)
    # Masked-out positions may hold anything (padding, -inf); keep them out of exp.
    log_ratio_BT = jnp.where(on_BT, logp_BT - old_logp_BT, 0.0)
    if cfg.ratio_level == "sequence":
        # GSPO: the value is the sequence ratio exp(mean log-ratio); the gradient per token is
        # ratio · dlogp_t, so with seq_mean_token_mean it is exactly d(sequence ratio).
        slots_BT, n = _segment_slots(segment_ids_BT)
        seq_lr = _segment_sum(log_ratio_BT * m_BT, slots_BT, n)
        seq_lr = seq_lr / jnp.maximum(_segment_sum(m_BT, slots_BT, n), 1.0)
        log_ratio_BT = logp_BT - jax.lax.stop_gradient(logp_BT) + jax.lax.stop_gradient(
            seq_lr[slots_BT])
        log_ratio_BT = jnp.where(on_BT, log_ratio_BT, 0.0)
    pg_BT, ratio_BT, pg_metrics = _pg_term(log_ratio_BT, logp_BT, adv_BT, on_BT, cfg)
    is_BT, keep_BT, stale_BT = _correction(
        cfg, on_BT, segment_ids_BT, old_logp_BT,
        None if rollout_logp_BT is None else rollout_logp_BT.astype(jnp.float32), age_BT)
    neg_BT = adv_BT < 0

    # A masked token leaves the loss (policy, KL and entropy terms); the denominators stay
    # the loss mask's (see lrl.rl.correction).
    w_BT = token_weights(m_BT, segment_ids_BT, denoms, cfg.aggregation) * keep_BT
    pg_loss = jnp.sum(w_BT * jnp.where(on_BT, pg_BT * is_BT * stale_BT, 0.0))
    kl = (jnp.sum(w_BT * jnp.where(on_BT, _kl(logp_BT, ref_logp_BT, cfg.kl_estimator), 0.0))
          if ref_logp_BT is not None else jnp.zeros((), jnp.float32))
    entropy = (jnp.sum(w_BT * jnp.where(on_BT, entropy_BT.astype(jnp.float32), 0.0))
               if entropy_BT is not None else jnp.zeros((), jnp.float32))
    loss = pg_loss + cfg.kl_coef * kl - cfg.entropy_coef * entropy

    tok = jnp.maximum(denoms.tokens, 1.0)
    frac = lambda c_BT: jnp.sum(jnp.where(on_BT & c_BT, 1.0, 0.0)) / tok  # noqa: E731
    ratio_sg = jax.lax.stop_gradient(ratio_BT)
    metrics = {
        "loss": loss, "pg_loss": pg_loss, "kl": kl, "entropy": entropy,
        "clip_frac_low": frac(neg_BT & (ratio_sg < 1.0 - cfg.clip_low)),
        "clip_frac_high": frac((adv_BT > 0) & (ratio_sg > 1.0 + cfg.clip_high)),
        "dual_clip_frac": (frac(neg_BT & (ratio_sg > cfg.dual_clip))
                           if cfg.dual_clip is not None else jnp.zeros((), jnp.float32)),
        "ratio_mean": jnp.sum(jnp.where(on_BT, ratio_sg, 0.0)) / tok,
        "ratio_min": jnp.min(jnp.where(on_BT, ratio_sg, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(on_BT, ratio_sg, -jnp.inf)),
        # the rollout correction: mean IS weight (before masking), the shares of trained
        # tokens and of sequences the mask dropped, the mean staleness weight
        "tis_weight_mean": jnp.sum(jnp.where(on_BT, is_BT, 0.0)) / tok,
        "masked_token_frac": jnp.sum(jnp.where(on_BT, 1.0 - keep_BT, 0.0)) / tok,
        "masked_seq_frac": (correction.masked_sequences(keep_BT, on_BT, segment_ids_BT)
                            / jnp.maximum(denoms.sequences, 1.0)),
        "staleness_weight_mean": jnp.sum(jnp.where(on_BT, stale_BT, 0.0)) / tok,
        "tokens": m_BT.sum(),
    }
    # a registered policy loss's own metrics: token means over the minibatch
    metrics.update({f"policy_loss/{k}": jnp.sum(jnp.where(on_BT, v, 0.0)) / tok
                    for k, v in pg_metrics.items()})
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def token_loss_aux(mask_BT, segment_ids_BT, denoms: Denominators, cfg: LossConfig, *,
                   adv_BT, old_logp_BT=None, ref_logp_BT=None, rollout_logp_BT=None,
                   age_BT=None) -> dict:
    """The per-token constants of `token_loss` ([B, T] float32 each): weight (the aggregation's,
    zero off the mask and on tokens the rollout correction masks), advantage, and where given
    the old and reference log-probs; `corr`, the rollout correction's weight of the policy term
    (IS x staleness), formed here over whole sequences. Without old log-probs the batch is
    on-policy: old = current, without gradient, and a token-level correction is formed in
    `token_loss` from the pass's own log-probs (the sampler's ride along as `rollout`); a
    sequence-level one needs them before the pass, so it needs old_logp_BT."""
    if cfg.ratio_level != "token":
        raise ValueError("loss: a per-token loss needs ratio_level='token' (GSPO's sequence "
                         "ratio couples the tokens of a sequence)")
    _check_terms(cfg, ref_logp_BT, rollout_logp_BT, age_BT)
    m_BT = _float_mask(mask_BT, segment_ids_BT)
    on_BT = m_BT > 0
    w_BT = jnp.where(on_BT, token_weights(m_BT, segment_ids_BT, denoms, cfg.aggregation), 0.0)
    aux = {"on": on_BT.astype(jnp.float32), "adv": adv_BT}
    for key, x in (("old", old_logp_BT), ("ref", ref_logp_BT)):
        if x is not None:
            aux[key] = x
    if cfg.corrects_rollout or cfg.weighs_staleness:
        on_policy = old_logp_BT is None
        if on_policy and cfg.corrects_sequences:
            raise ValueError(
                f"loss: a sequence-level rollout correction (tis_level={cfg.tis_level!r}, "
                f"mask_level={cfg.mask_level!r}) needs old_logp_BT: the fused pass forms each "
                "token's term before the sequence's other log-probs exist")
        rollout = None if rollout_logp_BT is None else jnp.asarray(rollout_logp_BT, jnp.float32)
        # On-policy, the IS weight and mask wait for this pass's log-probs (`token_loss`).
        w_is, keep, stale = _correction(
            cfg, on_BT, segment_ids_BT, None if on_policy else jnp.asarray(old_logp_BT),
            None if on_policy else rollout, age_BT)
        aux["corr"] = w_is * stale
        w_BT = w_BT * keep
        if on_policy and cfg.corrects_rollout:
            aux["rollout"] = rollout
    aux["w"] = w_BT
    return {k: jnp.asarray(x, jnp.float32) for k, x in aux.items()}


def token_loss(logp, ent, aux, *, cfg: LossConfig):
    """Each token's share of `packed_policy_loss`'s loss (token-level ratios), elementwise:
    summed over tokens it is that loss, and so is its gradient in logp and ent. `aux` comes
    from `token_loss_aux` (any shape, the same for every entry)."""
    on = aux["on"] > 0
    old = aux["old"] if "old" in aux else jax.lax.stop_gradient(logp)
    pg, _, _ = _pg_term(jnp.where(on, logp - old, 0.0), logp, aux["adv"], on, cfg)
    corr, keep = aux.get("corr", 1.0), 1.0
    if "rollout" in aux:   # on-policy: this pass's log-probs are the trainer's old ones
        w_is, keep, _ = _correction(cfg, on, None, old, aux["rollout"], None)
        corr = corr * w_is
    term = jnp.where(on, pg * corr, 0.0)
    if cfg.kl_coef != 0.0:
        term = term + cfg.kl_coef * jnp.where(on, _kl(logp, aux["ref"], cfg.kl_estimator), 0.0)
    if cfg.entropy_coef != 0.0:
        term = term - cfg.entropy_coef * jnp.where(on, ent, 0.0)
    return aux["w"] * keep * term


def combine_metrics(a: dict, b: dict) -> dict:
    """Merges the metrics of two micro-batches: extremes by min/max, everything else adds."""
    if a.keys() != b.keys():
        raise ValueError(f"combine_metrics: different keys {sorted(a)} vs {sorted(b)}")
    out = {}
    for k in a:
        op = jnp.minimum if k.endswith("_min") else jnp.maximum if k.endswith("_max") else jnp.add
        out[k] = op(a[k], b[k])
    return out


def policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, *, clip_low=0.2, clip_high=0.2,
                dual_clip=None, ratio_level="token", aggregation="token_mean", max_len=None,
                ref_logp_BT=None, kl_coef=0.0, kl_estimator="k3", entropy_BT=None,
                entropy_coef=0.0, rollout_logp_BT=None, tis_cap=None, tis_level="token",
                mask_level=None, mask_low=0.5, mask_high=2.0, age_B=None, staleness_decay=1.0,
                max_staleness=None, policy_loss="ppo_clip"):
    """Clipped policy-gradient loss of B sequences (one per row) -> (loss, metrics).

    ratio = exp(logp - old_logp) per token (`ratio_level="token"`) or, GSPO, the exp of the
    masked mean log-ratio of the sequence (`"sequence"`), either log-ratio clipped to
    [-20, 20] (verl clips the token one alike, GSPO's sequence one at +10 only); per-token loss
    max(-A·ratio, -A·clip(ratio, 1-clip_low, 1+clip_high)) (clip-higher when clip_high >
    clip_low, as DAPO); `dual_clip=c` caps it at -c·A where A < 0 (as verl).
    aggregation: token_mean = sum / masked tokens (DAPO); seq_mean_token_mean = mean over
    sequences of each sequence's token mean (GRPO); seq_mean_token_sum_norm = sum /
    (B · max_len), max_len defaulting to T (Dr. GRPO).
    KL to the reference (k1 = logp - ref, k2 = ½(logp - ref)², k3 = min(exp(ref - logp) -
    (ref - logp) - 1, 10) as verl's low_var_kl; ref - logp clipped to [-20, 20] first, so
    k1 lies in [-20, 20] and k2 in [0, 200]) aggregated the same way, times kl_coef; minus
    entropy_coef × the aggregated entropy.
    Rollout correction (lrl.rl.correction), all without gradient, from Δ = old_logp -
    rollout_logp (the trainer's old log-probs against the sampler's) over a row's masked
    tokens: with `tis_cap`, the policy term is weighted by min(ratio, tis_cap), the ratio
    taken at `tis_level` (token: e^Δ_t; sequence: exp ΣΔ; geometric: exp mean Δ); with
    `mask_level`, a token (token) or a whole sequence (sequence, geometric) whose ratio at
    that level leaves [mask_low, mask_high] leaves the loss, the denominators unchanged; with
    `staleness_decay` or `max_staleness`, row b's policy term is weighted by
    staleness_decay ** age_B[b], 0 past max_staleness.
    `policy_loss`: the per-token policy term, "ppo_clip" (the above) or another registered
    name or "pkg.module:function" (`lrl.rl.registry`); aggregation, KL, entropy and the
    rollout correction apply to it alike.
    """
    logp_BT = jnp.asarray(logp_BT)
    if logp_BT.ndim != 2:
        raise ValueError(f"policy_loss: logp_BT must be [B, T], got shape {logp_BT.shape}")
    b, t = logp_BT.shape
    adv_B = jnp.asarray(adv_B)
    if adv_B.shape != (b,):
        raise ValueError(f"policy_loss: adv_B must be [B]=({b},), got shape {adv_B.shape}")
    cfg = LossConfig(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                     ratio_level=ratio_level, aggregation=aggregation,
                     max_len=t if max_len is None else max_len, kl_coef=kl_coef,
                     kl_estimator=kl_estimator, entropy_coef=entropy_coef, tis_cap=tis_cap,
                     tis_level=tis_level, mask_level=mask_level, mask_low=mask_low,
                     mask_high=mask_high, staleness_decay=staleness_decay,
                     max_staleness=max_staleness, policy_loss=policy_loss)
    seg_BT = jnp.ones((b, t), jnp.int32)
    # Unpacked, B counts every row (Dr. GRPO's constant normaliser), even one without tokens.
    denoms = loss_denominators(mask_BT, seg_BT)._replace(
        sum_norm=jnp.asarray(float(b * cfg.max_len), jnp.float32))
    adv_BT = jnp.broadcast_to(adv_B[:, None], (b, t))
    as_array = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    age_BT = None if age_B is None else jnp.broadcast_to(
        jnp.asarray(age_B, jnp.float32)[:, None], (b, t))
    return packed_policy_loss(logp_BT, jnp.asarray(old_logp_BT), adv_BT, jnp.asarray(mask_BT),
                              seg_BT, denoms, cfg, ref_logp_BT=as_array(ref_logp_BT),
                              rollout_logp_BT=as_array(rollout_logp_BT), age_BT=age_BT,
                              entropy_BT=as_array(entropy_BT))
