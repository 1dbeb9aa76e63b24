"""Registries of advantage estimators and policy losses, selected by config, as verl's
register_adv_est / register_policy_loss (and lrl's reward registry).

`rl.estimator` and `rl.loss.policy_loss` take a registered name or "my_pkg.my_module:my_fn"
(the module imported, the function looked up in it). The built-ins register here through the
same calls (`lrl.rl.advantages`, `lrl.rl.losses`); see docs/extending.md.

Outcome estimators (one score per sample, the GRPO family):
    fn(rewards_PG, *, lengths_PG=None, mask_P=None, baseline_P=None, eps=...) -> advantages_PG
  rewards_PG [P, G] float32 (numpy); the keyword arguments a function names are the only ones
  it is given: lengths_PG [P, G] response tokens of each sample, mask_P [P] bool the rows that
  hold a real group (the others are padding to a fixed P and should get 0), baseline_P [P]
  float32 the reward of one greedy sample per prompt (asking for it makes the rollout draw
  that sample), eps the estimator's epsilon. Returns [P, G]: every response token of sample
  (p, g) gets advantages_PG[p, g].
Token-level estimators (`kind="token"`, e.g. "gae") take token rewards and a critic's values
and run in the step's update path; `needs_critic` says the run must train a critic.

Policy losses (the per-token policy-gradient term of the update's loss):
    fn(logp_BT, old_logp_BT, adv_BT, mask_BT, cfg) -> (loss_BT, metrics)
  per-token arrays of any one shape (float32; mask_BT bool), cfg the run's
  `lrl.rl.losses.LossConfig` (its clip_low / clip_high / dual_clip are there to read);
  loss_BT is each token's term (what the loss aggregates with the run's `aggregation`, and
  to which lrl adds its KL and entropy terms and the rollout correction's weights); metrics
  a dict of per-token arrays, logged as their mean over the minibatch's tokens under
  "policy_loss/<key>". It must be elementwise (each token's term from that token's inputs:
  the fused lm head forms it chunk by chunk) and differentiable in logp_BT; old_logp_BT
  carries no gradient. With GSPO's ratio_level="sequence", logp - old_logp is the sequence
  log-ratio.

Dimension letters: P prompts · G samples per prompt · B batch rows · T positions.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable

# What an outcome estimator may ask for by naming it.
OUTCOME_KWARGS = ("lengths_PG", "mask_P", "baseline_P", "eps")
KINDS = ("outcome", "token")


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered (or imported) advantage estimator."""
    name: str
    fn: Callable
    kind: str = "outcome"        # outcome | token
    needs_critic: bool = False

    @property
    def wants(self) -> frozenset:
        """The optional inputs an outcome estimator asks for (by its parameter names)."""
        params = inspect.signature(self.fn).parameters
        return frozenset(k for k in OUTCOME_KWARGS if k in params)

    @property
    def needs_baseline(self) -> bool:
        """The rollout must score one greedy sample per prompt (ReMax's baseline)."""
        return self.kind == "outcome" and "baseline_P" in self.wants


_ESTIMATORS: dict[str, Estimator] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"{what} name must be a non-empty string without ':', got {name!r}")


def _same(a: Callable, b: Callable) -> bool:
    # A re-import of the same module (pytest, spawned workers) registers an equal function.
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None), getattr(b, "__qualname__", None))


def register_estimator(name: str, *, kind: str = "outcome", needs_critic: bool = False):
    """Decorator registering an advantage estimator under `name` (see the module docstring
    for the signature); registering the same function again is a no-op."""
    _check_name("estimator", name)
    if kind not in KINDS:
        raise ValueError(f"estimator {name!r}: kind must be one of {KINDS}, got {kind!r}")

    def deco(fn: Callable) -> Callable:
        old = _ESTIMATORS.get(name)
        if old is not None and not _same(old.fn, fn):
            raise ValueError(f"estimator {name!r} is already registered by "
                             f"{old.fn.__module__}.{old.fn.__qualname__}")
        est = Estimator(name, fn, kind, needs_critic)
        if kind == "outcome":
            _check_outcome_signature(est, key="estimator")
        _ESTIMATORS[name] = est
        return fn

    return deco


def register_policy_loss(name: str):
    """Decorator registering a policy loss under `name` (see the module docstring)."""
    _check_name("policy loss", name)

    def deco(fn: Callable) -> Callable:
        old = _POLICY_LOSSES.get(name)
        if old is not None and not _same(old, fn):
            raise ValueError(f"policy loss {name!r} is already registered by "
                             f"{old.__module__}.{old.__qualname__}")
        _check_loss_signature(fn, name, key="policy loss")
        _POLICY_LOSSES[name] = fn
        return fn

    return deco


def estimator_names() -> list[str]:
    """The registered estimators, in registration order (the built-ins first)."""
    return list(_ESTIMATORS)


def policy_loss_names() -> list[str]:
    return list(_POLICY_LOSSES)


def _import(spec: str, key: str) -> Callable:
    """"pkg.mod:fn" -> the function, or a ValueError naming the config key."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{key}={spec!r}: expected a registered name or 'pkg.module:function'")
    try:
        mod = importlib.import_module(module)
    except Exception as e:   # ImportError, or the module failing as it runs
        raise ValueError(f"{key}={spec!r}: cannot import module {module!r}: "
                         f"{type(e).__name__}: {e}") from e
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{key}={spec!r}: module {module!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"{key}={spec!r}: {attr!r} in {module!r} is not callable")
    return fn


def _check_outcome_signature(est: Estimator, key: str) -> None:
    try:
        params = list(inspect.signature(est.fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise ValueError(f"{key}={est.name!r}: cannot read the function's signature: {e}") from e
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise ValueError(f"{key}={est.name!r}: an outcome estimator takes rewards_PG as its "
                         f"first argument: fn(rewards_PG, *, {', '.join(OUTCOME_KWARGS)}) -> "
                         f"advantages_PG; got {inspect.signature(est.fn)}")
    required = [p.name for p in params[1:] if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                and p.name not in OUTCOME_KWARGS]
    if required:
        raise ValueError(f"{key}={est.name!r}: the estimator requires {required}, which lrl does "
                         f"not pass; it passes rewards_PG and, when named, "
                         f"{', '.join(OUTCOME_KWARGS)} (signature {inspect.signature(est.fn)})")


def _check_loss_signature(fn: Callable, name: str, key: str) -> None:
    try:
        sig = inspect.signature(fn)
        sig.bind(None, None, None, None, None)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{key}={name!r}: a policy loss is fn(logp_BT, old_logp_BT, adv_BT, "
                         f"mask_BT, cfg) -> (loss_BT, metrics); cannot call it that way: {e}"
                         ) from e


def _named(spec: str, key: str, table: dict, what: str, a_what: str):
    """(the registered entry, None) for a name, (None, the function) for "pkg.module:function";
    a ValueError naming `key` for anything else."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key}={spec!r}: expected {a_what} name or 'pkg.module:function'")
    if ":" in spec:
        return None, _import(spec, key)
    if spec not in table:
        raise ValueError(f"{key}={spec!r}: unknown {what}; registered: "
                         f"{', '.join(table)}, or 'pkg.module:function'")
    return table[spec], None


def estimator(spec: str, key: str = "rl.estimator") -> Estimator:
    """The estimator a config names: a registered name or "pkg.module:function" (an outcome
    estimator; register it with `register_estimator` for a token-level one). Raises a
    ValueError naming `key` when the name is unknown, the module or function does not import,
    or the signature does not fit."""
    registered, fn = _named(spec, key, _ESTIMATORS, "estimator", "an estimator")
    if registered is not None:
        return registered
    for est in _ESTIMATORS.values():   # a registered function named by its path
        if est.fn is fn:
            return dataclasses.replace(est, name=spec)
    est = Estimator(spec, fn)
    _check_outcome_signature(est, key)
    return est


def policy_loss_fn(spec: str, key: str = "rl.loss.policy_loss") -> Callable:
    """The policy loss a config names: a registered name or "pkg.module:function"."""
    registered, fn = _named(spec, key, _POLICY_LOSSES, "policy loss", "a policy loss")
    if registered is not None:
        return registered
    _check_loss_signature(fn, spec, key)
    return fn


def check(estimator_spec: str, policy_loss_spec: str = "ppo_clip", *,
          critic: bool = False) -> Estimator:
    """Start-up check (`lrl.options`, a preflight): both names resolve and their functions
    fit, and an estimator that needs a critic gets one (`critic`: the run trains one); raises
    a ValueError naming the config key otherwise. -> the estimator."""
    import lrl.rl  # noqa: F401  (registers the built-ins)
    est = estimator(estimator_spec)
    if est.needs_critic and not critic:
        raise ValueError(f"rl.estimator={estimator_spec!r} is token-level and needs a critic "
                         "(a value model), which this run does not train")
    policy_loss_fn(policy_loss_spec)
    return est
