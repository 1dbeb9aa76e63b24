"""The command line of `python -m lrl.main`: `--help` (exit 0), `--print_config` (the resolved
config, every field with its doc from `lrl.schema`), and parse errors in one line
(a misspelt config field names the closest existing one) rather than a traceback.

Nothing here imports jax, so `--help` and `--print_config` answer at once.
"""
from __future__ import annotations

import ast
import difflib
import glob
import os
import re
import sys

from absl import flags

from lrl import schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "python -m lrl.main"
_HELP_FLAGS = ("-h", "--help", "-help", "--helpshort", "-?")

USAGE = f"""\
Runs one lrl experiment:

  {PROG} --config=configs/FILE.py[:ARG] --workdir=DIR [--config.FIELD=VALUE ...]

  --config=FILE[:ARG]   the experiment: a configs/*.py file (its docstring has its command;
                        ARG picks a variant, e.g. configs/default.py:runlocal)
  --workdir=DIR         where checkpoints, metrics.jsonl, samples.jsonl, TensorBoard events
                        and plots go; the same command on the same DIR resumes the run
  --config.FIELD=VALUE  override any field of the config, e.g. --config.rl.steps=20
  --print_config        print the resolved config (overrides applied), every field with its
                        doc, and exit: the list of FIELDs there are
  --verbosity=0         show libraries' INFO logs too (orbax, jax, grain); without the flag
                        the console shows lrl's progress, warnings and errors only
  --helpfull            every flag, absl's included

Examples:
  {PROG} --config=configs/default.py --workdir=/tmp/lrl-default
  {PROG} --config=configs/default.py:runlocal --workdir=/tmp/lrl-smoke
  {PROG} --config=configs/default.py --print_config
  {PROG} --config=configs/default.py --workdir=/tmp/run --config.rl.steps=40 \\
      --config.rl.group_size=8
"""


def help_text() -> str:
    """The usage above and the config files with the first line of each docstring."""
    rows = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        with open(path) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        rows.append(f"  configs/{os.path.basename(path):<22} {doc.splitlines()[0] if doc else ''}")
    docs = schema.docs()
    sections = [f"  {f.name:<13} {docs[f.name]}" for f in schema.fields(schema.Config)
                if schema.nested(f) is not None]
    return (USAGE + ("\nConfigs:\n" + "\n".join(rows) + "\n" if rows else "")
            + "\nConfig sections (lrl/schema.py; --print_config lists every field with its doc):\n"
            + "\n".join(sections) + "\n")


def fail(message: str, code: int = 2):
    """One line on stderr and exit: what was wrong, and where to look."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (app.run's `flags_parser`), with --help that exits 0 and errors
    that are one line."""
    if any(a in _HELP_FLAGS for a in argv[1:]):
        print(help_text(), end="", flush=True)
        sys.exit(0)
    try:
        rest = flags.FLAGS(argv)
    except SystemExit as e:  # absl's --helpfull printed every flag, then exits 1: not an error
        if e.code == 1 and any(a in ("--helpfull", "-helpfull") for a in argv[1:]):
            sys.exit(0)
        raise
    except (AttributeError, KeyError):  # ml_collections: an override naming no field
        message = unknown_field_message(argv)
        if message is None:
            raise
        fail(message)
    except flags.Error as e:
        text = str(e)
        if "Error whilst parsing config file" in text:  # get_config raised: its last line
            text = f"--config={_config_arg(argv)}: {_last_line(text)}"
        fail(" ".join(text.split()) + f" ({PROG} --help shows the flags)")
    try:  # ml_collections defers a config file that fails to load to its first use
        flags.FLAGS["config"].value.get("job")
    except OSError as e:
        fail(f"--config={_config_arg(argv)}: {_last_line(str(e))}")
    return rest


def _last_line(text: str) -> str:
    return [line.strip() for line in text.splitlines() if line.strip()][-1]


# ----------------------------------------------------------------------------- fields

def flat_fields(config, prefix: str = "") -> dict:
    """{"rl.group_size": 16, ...}: every leaf of a ConfigDict, by dotted path."""
    out = {}
    for k, v in config.items():
        path = f"{prefix}{k}"
        if hasattr(v, "items") and hasattr(v, "lock"):
            out.update(flat_fields(v, path + "."))
        else:
            out[path] = v
    return out


def _config_arg(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def unknown_field_message(argv: list[str]) -> str | None:
    """The first `--config.X` of argv that names no field of the config, with the nearest
    existing field; None when every override names a field (the error was another one)."""
    spec = _config_arg(argv)
    if spec is None:
        return None
    path, _, arg = spec.partition(":")
    from lrl.config_util import load as config_from_file
    try:
        config = config_from_file(path, arg or None)
    except Exception:  # noqa: BLE001 -- absl reports an unloadable file itself
        return None
    fields = flat_fields(config)
    known = set(fields) | {p.rsplit(".", i)[0] for p in fields for i in range(1, p.count(".") + 1)}
    for a in argv[1:]:
        m = re.match(r"--(?:no)?config\.([^=]+)", a)
        if not m or m.group(1) in known:
            continue
        bad = m.group(1)
        near = difflib.get_close_matches(bad, fields, n=1, cutoff=0.6) or [
            p for p in fields if p.rsplit(".", 1)[-1] == bad.rsplit(".", 1)[-1]][:1]
        hint = f"did you mean --config.{near[0]}? " if near else ""
        return (f"--config.{bad}: {path} has no field {bad!r}; {hint}"
                f"({PROG} --config={spec} --print_config lists every field)")
    return None


# ----------------------------------------------------------------------------- --print_config

def _owner(field: str, docs: dict) -> str | None:
    """The schema path that documents `field`: itself, or the dict field it is under
    (data.task_kwargs.arithmetic.num_terms -> data.task_kwargs)."""
    while field and field not in docs:
        field = field.rpartition(".")[0]
    return field or None


def config_listing(config, spec: str) -> list[str]:
    """The resolved config, one `FIELD = VALUE  # doc` line per field in the schema's order
    (`lrl.schema`: each field's doc), under a header per section."""
    docs = schema.docs()
    sections = {path for path, f in schema.walk() if schema.nested(f) is not None}
    rank = {path: i for i, path in enumerate(docs)}
    fields = flat_fields(config)
    order = {f: i for i, f in enumerate(fields)}

    def key(f):
        owner = _owner(f, docs)
        return (rank[owner] if owner else len(rank), order[f])

    out = [f"# {spec}, resolved with the overrides given. Each line can be given as "
           f"--config.FIELD=VALUE."]
    section, documented = None, set()
    for f in sorted(fields, key=key):
        head = f.rpartition(".")[0]
        while head and head not in sections:   # a dict field's entries stay in its section
            head = head.rpartition(".")[0]
        if head and head != section:
            section = head
            out.append(f"\n# --- {head}: {docs[head]}")
        line = f"{f} = {fields[f]!r}"
        owner = _owner(f, docs)
        if owner and owner not in documented and docs[owner]:
            documented.add(owner)
            line = f"{line:<44} # {docs[owner]}"
        out.append(line)
    return out


def print_config(config, spec: str) -> None:
    try:
        print("\n".join(config_listing(config, spec)), flush=True)
    except BrokenPipeError:  # `--print_config | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
