"""Writes tests/golden/config_defaults.json (run from the repository root; see
tests/test_schema.py): for every config variant of tests/test_configs.py, its fields and
their values, and its resolved options (every field and the step policy's properties), each
value as its repr, so a changed default, type (1 against 1.0) or derived policy shows.

The committed file was written from main at 09611ac, before the fields moved into
lrl/schema.py; rewrite it only for a default changed on purpose."""
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.getcwd())
from lrl import cli, config_util, options  # noqa: E402
from tests.test_configs import ARGS, CONFIGS  # noqa: E402

POLICY = ("rl_steps", "model.shard_axes", "rl.uses_critic", "rl.needs_ppo_pass",
          "rl.plain_sampling", "rl.old_logp", "rl.update_measures_mismatch",
          "rl.carries_rollout_logp", "rl.loss.corrects_rollout", "rl.loss.weighs_staleness")


def flat(x, prefix=""):
    """{"rl.loss.clip_low": "0.2", ...}: every leaf of the options, dicts included."""
    if dataclasses.is_dataclass(x):
        items = [(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)]
    elif isinstance(x, dict):
        items = list(x.items())
    else:
        return {prefix[:-1]: repr(x)}
    out = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}{k}."))
    return out


def resolved(o):
    out = flat(o)
    for path in POLICY:
        v = o
        for name in path.split("."):
            v = getattr(v, name)
        out["policy:" + path] = repr(v)
    out["policy:mesh.sizes"] = repr(o.mesh.sizes())
    return dict(sorted(out.items()))


def main():
    out = {}
    for path in CONFIGS:
        name = os.path.basename(path)
        for arg in ARGS.get(name, [None]):
            c = config_util.load(path, arg)
            if c.data.source != "synthetic":
                c.data.paths = "/data/train.jsonl"
            spec = f"configs/{name}" + (f":{arg}" if arg else "")
            out[spec] = dict(
                fields=dict(sorted((k, repr(v)) for k, v in cli.flat_fields(c).items())),
                options=resolved(options.from_config(c, check_files=False)))
    with open("tests/golden/config_defaults.json", "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(len(out), "variants")


if __name__ == "__main__":
    main()
