"""What a config file may import from lrl: loading another config file and parsing the
`:arg` of `--config=configs/X.py:arg`. Nothing here imports jax, so a config can be built,
read and linted on a machine (or in a process) that has only ml_collections.

    def get_config(arg=None):
        a = config_util.parse_arg(arg, runlocal=False)
        c = config_util.load_sibling(__file__, "default.py")
        ...
"""
from __future__ import annotations

import importlib.util
import os

import ml_collections


def load(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of a config file (configs/ is a folder of files, not a package)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config file {path!r}")
    spec = importlib.util.spec_from_file_location(
        "lrl_config_" + os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg) if arg else mod.get_config()


def load_sibling(this_file: str, name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """The config `name` in the same folder as `this_file`: how one config builds on another."""
    return load(os.path.join(os.path.dirname(os.path.abspath(this_file)), name), arg)


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """big_vision's `parse_arg`: "runlocal,size=7b" -> {runlocal: True, size: "7b"} over the
    given defaults. A bare word names a bool default (set to True) or, when exactly one default
    is not a bool, is that default's value (so `:7b` works for `size="1.5b"`). Values take the
    type of their default; an unknown word or key is an error that lists the valid ones."""
    out = dict(defaults)
    valued = [k for k, v in defaults.items() if not isinstance(v, bool)]
    for word in (w.strip() for w in (arg or "").split(",") if w.strip()):
        key, eq, value = word.partition("=")
        if not eq:
            if isinstance(defaults.get(word), bool):
                out[word] = True
                continue
            if len(valued) != 1:
                raise ValueError(f"config argument {word!r}: not one of "
                                 f"{sorted(k for k in defaults if k not in valued)} and no "
                                 f"single value to set (arguments: {sorted(defaults)})")
            key, value = valued[0], word
        if key not in defaults:
            raise ValueError(f"config argument {key!r}: valid ones are {sorted(defaults)}")
        kind = type(defaults[key])
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"config argument {key}={value!r}: expected true or false")
            out[key] = value.lower() in ("true", "1")
        else:
            try:
                out[key] = kind(value)
            except ValueError:
                raise ValueError(f"config argument {key}={value!r}: expected a "
                                 f"{kind.__name__}") from None
    return ml_collections.ConfigDict(out)
