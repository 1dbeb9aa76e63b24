"""Worked example of a multi-turn environment (docs/environments.md): a number-guessing game
to copy and adapt. Select it by config without touching lrl:

    --config.rollout.env=experiments.plugins.guess_env:Guess

(or `import experiments.plugins.guess_env` somewhere and name it "guess"). Each dataset row
holds the secret (`{"secret": 37}`, or a `"seed"` to draw one); the model guesses, the
environment answers "higher" / "lower" as a user message, and a right guess ends the game
with reward 1, less `turn_cost` for every wrong guess before it. `rows(n)` makes a data set.

The things every environment needs, shown here:
  - a module-level class (steps run in reward worker processes, which import this module and
    unpickle the environment: keep its attributes plain data),
  - `reset(row)` cheap and deterministic from the row (it runs once per prompt, in the
    driver's process; every sample of the prompt starts from a copy of the result),
  - `step` reading the model's text (the turn without special tokens; the `<think>` block
    is the model's own business), returning `Step(observation, reward, done)`.
"""
from __future__ import annotations

import random
import re

from lrl.envs import Environment, Step, register

_THINK_RE = re.compile(r"<think>.*?(?:</think>|$)", re.S)
_INT_RE = re.compile(r"-?\d+")


@register("guess")
class Guess(Environment):
    """Guess a whole number in [1, max_value]; see the module docstring."""
    role = "user"     # the answers are the other player speaking, not a tool's output

    def __init__(self, max_value: int = 100, turn_cost: float = 0.05):
        if max_value < 2:
            raise ValueError(f"Guess: max_value must be >= 2, got {max_value}")
        self.max_value, self.turn_cost = max_value, turn_cost
        self.secret, self.wrong = 0, 0

    def reset(self, row) -> str:
        if "secret" in row:
            self.secret = int(row["secret"])
        elif "seed" in row:
            self.secret = random.Random(row["seed"]).randint(1, self.max_value)
        else:
            raise ValueError(f"Guess: a row needs 'secret' or 'seed', got {sorted(row)}")
        if not 1 <= self.secret <= self.max_value:
            raise ValueError(f"Guess: secret {self.secret} is not in [1, {self.max_value}]")
        self.wrong = 0
        return (f"I am thinking of a whole number from 1 to {self.max_value}. Guess it: answer "
                "with one number per turn and I will say higher or lower.")

    def step(self, turn_text: str, turn_tokens) -> Step:
        numbers = _INT_RE.findall(_THINK_RE.sub("", turn_text))
        if not numbers:
            self.wrong += 1
            return Step(f"Please answer with one whole number from 1 to {self.max_value}.")
        guess = int(numbers[-1])   # "I'll try 50" -> 50
        if guess == self.secret:
            return Step("Correct!", max(0.0, 1.0 - self.turn_cost * self.wrong), True)
        self.wrong += 1
        return Step("higher" if guess < self.secret else "lower")


def rows(n: int, seed: int = 0) -> list[dict]:
    """n dataset rows, each with its secret's seed."""
    return [{"seed": seed * 1_000_003 + i} for i in range(n)]
