"""The environment interface of multi-turn rollouts, and its registry.

A trajectory starts from a dataset row. `reset(row)` runs once per row in the driver's
process (keep it cheap: it sets the environment up, e.g. draws a secret from the row's seed)
and may return a first observation, which the data side puts into the prompt (`Driver.
first_observation`). After each model turn, `step(turn_text, turn_tokens)` gets the turn's
text (decoded without special tokens) and its token ids, and returns a `Step`:

    observation  text to append, rendered with the model's chat template as one message of
                 `role` (a list of texts: one message each, e.g. one per tool result); None
                 with done=False appends an empty message
    reward       this turn's reward (the final reward on the last turn)
    done         the trajectory ends here
    info         counts the driver sums: "tool_calls", "tool_errors"; "role" overrides the
                 environment's `role` ("tool" or "user") for this observation

Every sample of a prompt gets its own copy of the environment as `reset` left it, and steps
run in the reward worker processes: an environment must pickle (module-level classes; no
open files, locks or sockets in its attributes), and its module must be importable there.

Environments are registered by name, as rewards are, and a config names one
(`rollout.env="tools"`) or gives "pkg.module:Factory":

    @lrl.envs.register("guess")
    class Guess(lrl.envs.Environment): ...
    env = lrl.envs.make("guess", max_value=100)
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

ROLES = ("tool", "user")
Observation = Union[str, Sequence[str], None]


@dataclasses.dataclass
class Step:
    """What an environment answers to a model turn (see the module docstring)."""
    observation: Observation = None
    reward: float = 0.0
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)


class Environment:
    """Base class: override `step`, and `reset` when the row sets something up."""
    role: str = "tool"   # the chat role observations are rendered as: "tool" or "user"

    def reset(self, row: Mapping) -> Optional[str]:
        """Sets the environment up for a trajectory starting from `row`; -> an optional first
        observation (text the prompt should end with)."""
        return None

    def step(self, turn_text: str, turn_tokens) -> Step:
        raise NotImplementedError(f"{type(self).__name__} must implement step(turn_text, "
                                  "turn_tokens) -> Step")


Factory = Callable[..., Environment]
_REGISTRY: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator registering an environment class (or a factory returning one) under `name`;
    registering the same one again (a re-import) is a no-op."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"environment name must be a non-empty string without ':', got {name!r}")

    def deco(factory: Factory) -> Factory:
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (
                factory.__module__, factory.__qualname__):
            raise ValueError(f"environment {name!r} is already registered by "
                             f"{old.__module__}.{old.__qualname__}")
        _REGISTRY[name] = factory
        return factory

    return deco


def names() -> list[str]:
    """Sorted names of the registered environments."""
    _builtins()
    return sorted(_REGISTRY)


def _builtins() -> None:
    import lrl.envs.tool_env  # noqa: F401  (registers "tools")


def get(spec: str, key: str = "rollout.env") -> Factory:
    """The factory a config names: a registered name or "pkg.module:Factory"; a ValueError
    naming `key` and the registered names otherwise."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key}={spec!r}: expected an environment name or 'pkg.module:Factory'")
    if ":" not in spec:
        _builtins()
        if spec not in _REGISTRY:
            raise ValueError(f"{key}={spec!r}: unknown environment; registered: "
                             f"{', '.join(sorted(_REGISTRY))}, or 'pkg.module:Factory'")
        return _REGISTRY[spec]
    module, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as e:  # ImportError, or the module failing as it runs
        raise ValueError(f"{key}={spec!r}: cannot import module {module!r}: "
                         f"{type(e).__name__}: {e}") from e
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{key}={spec!r}: module {module!r} has no {attr!r}")
    if not callable(obj):
        raise ValueError(f"{key}={spec!r}: {attr!r} in {module!r} is not callable")
    return obj


def make(spec: Union[str, Factory], **kwargs) -> Environment:
    """A new environment: `spec` is a name, "pkg.module:Factory" or a factory; `kwargs` go
    to the factory (the config's environment options)."""
    factory = get(spec) if isinstance(spec, str) else spec
    env = factory(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"environment {spec!r} made a {type(env).__name__}, not an "
                        "lrl.envs.Environment")
    if env.role not in ROLES:
        raise ValueError(f"environment {spec!r}: role must be one of {ROLES}, got {env.role!r}")
    return env
