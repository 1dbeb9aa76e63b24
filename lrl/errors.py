"""Errors a person can fix, reported as one plain message instead of a traceback.

    python -m lrl.main: error: <what> — <the file or key> — <what to do>
      <a few indented lines, where a table helps>

A *user error* is one the person fixes without changing lrl: a config value or key, a path,
the data, the tokenizer, the model checkpoint, a workdir whose checkpoint does not fit the
config, device memory. It is raised as `UserError` (by `lrl.preflight`, which checks what a
run will read before anything is written, and where the loop meets such input), or is one of
the few library errors `user_error` recognises (a resume's `CheckpointError`, an XLA
out-of-memory). `run` prints it and returns `EXIT_CODE`; anything else is a bug and keeps its
traceback. `--verbosity` prints the traceback of a user error too, above its message.

`UserError` is a `ValueError`, so code that raised a ValueError for bad input may raise it
instead without breaking its callers.
"""
from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Callable, Sequence

EXIT_CODE = 2      # as a command-line usage error (argparse, absl): fix the input, run again
PROG = "python -m lrl.main"


class UserError(ValueError):
    """Bad input, said as what is wrong, where (the file or config key) and what to do."""

    def __init__(self, what: str, culprit: str, todo: str, details: Sequence[str] = ()):
        self.what, self.culprit, self.todo = what, culprit, todo
        self.details = tuple(details)
        super().__init__(self.message())

    def message(self) -> str:
        head = " — ".join(p for p in (self.what, self.culprit, self.todo) if p)
        return "\n".join([head, *(f"  {d}" for d in self.details)])


_KEY = re.compile(r"^(?:config\.)?([a-z_]+(?:\.[a-z_0-9]+)+)")


def config_key(message: str) -> str | None:
    """The dotted config key a message of `lrl.options` starts with (`rl.group_size=0: ...`,
    `data.paths: no file ...`), or None."""
    m = _KEY.match(message.strip())
    return m.group(1) if m else None


def from_config_error(e: Exception) -> UserError:
    """`lrl.options.from_config`'s ValueError / FileNotFoundError as a user error naming the
    key its message starts with."""
    text = str(e)
    key = config_key(text)
    m = re.match(r"config section '([a-z_.]+)'|([a-z_]+):", text)
    if key is None and m:
        return UserError(text, f"config section {m.group(1) or m.group(2)}",
                         f"{PROG} --config=FILE --print_config lists every field with its "
                         "comment")
    culprit = f"config key {key}" if key else "the config"
    if isinstance(e, FileNotFoundError):
        todo = (f"point --config.{key}=... at an existing path" if key else
                "fix the path in the config")
    else:
        todo = (f"change it in the config file or with --config.{key}=VALUE "
                "(--print_config lists every field with its comment)" if key else
                "fix the config (--print_config lists every field with its comment)")
    return UserError(text, culprit, todo)


def out_of_memory(e: BaseException, config=None) -> UserError | None:
    """An XLA out-of-memory (at a compile or a run), with its numbers and the settings that
    shrink what the device holds; None for any other error."""
    name = type(e).__name__
    if name not in ("JaxRuntimeError", "XlaRuntimeError"):
        return None
    from lrl.rl import budget
    if not budget.out_of_memory(e):
        return None
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    first = next((x for x in lines if "RESOURCE_EXHAUSTED" in x or "memory" in x.lower()),
                 lines[0] if lines else name)

    def now(key):
        if config is None:
            return ""
        node = config
        for part in key.split("."):
            node = node[part]
        return f" (now {node!r})"
    if budget.out_of_host_memory(e):
        return UserError(f"out of pinned host memory: {first[:300]}", host_memory_culprit(),
                         host_memory_todo(now("optim.offload"), now("model.param_dtype")))
    return UserError(
        f"out of device memory: {first[:300]}", "device memory",
        "shrink what a step holds: lower rl.max_tokens_per_micro" + now("rl.max_tokens_per_micro")
        + " (0 = sized from device memory) or rollout.pool_fraction"
        + now("rollout.pool_fraction") + " (or set rollout.pool_tokens), use model.remat='full'"
        + now("model.remat") + ", or fewer rollout.max_slots" + now("rollout.max_slots"),
        details=("docs/troubleshooting.md#out-of-memory lists what each setting costs",))


def host_memory_culprit() -> str:
    from lrl import xla_env
    limit = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    return ("pinned host memory, capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
            + (f"={limit}" if limit else f" (unset: jax's {xla_env.PINNED_DEFAULT_GB} GB)"))


def host_memory_todo(offload_now: str = "", param_dtype_now: str = "") -> str:
    from lrl import xla_env
    return ("raise XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (python -m lrl.main sets "
            f"{xla_env.PINNED_HOST_SHARE:.0%} of the host's memory when it is unset) or free "
            "the host's memory; or hold less there: "
            "optim.offload='off'" + offload_now + " keeps the masters and moments on the device, "
            "which holds them with model.param_dtype='bfloat16'" + param_dtype_now
            + " or with more devices (mesh.fsdp)")


def out_of_disk(e: BaseException, config=None, workdir: str | None = None) -> UserError | None:
    """A write that failed on a full disk (a checkpoint's, mostly), with the free space, the
    size of a checkpoint and the uncommitted save left behind; None for any other error."""
    from lrl import checkpoint_space as space
    if not space.no_space(e):
        return None
    first = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
    first = first if len(first) <= 400 else "..." + first[-400:]   # the errno's text ends it
    if not workdir:
        return UserError("out of disk space", "the run's disk",
                         "free space, or point --workdir at a larger disk", details=(first,))
    from lrl import checkpoint as ckpt
    free = space.free_bytes(workdir)
    ckdir = os.path.join(workdir, "checkpoints")
    steps = sorted(int(n) for n in (os.listdir(ckdir) if os.path.isdir(ckdir) else ())
                   if n.isdigit())
    cut = ckpt._uncommitted(ckpt.epath.Path(ckdir), after=-1)
    try:
        keep = config["checkpoint"]["keep"]
    except (KeyError, TypeError, AttributeError):
        keep = None
    details = [first]
    if steps:
        details.append(f"a checkpoint of this run takes "
                       f"{space.size(space.estimate(ckdir, steps, 0)[0])} "
                       f"(step {steps[-1]}, the newest committed: the run resumes from it)")
    details += [f"{p} is a save cut short ({space.size(space.dir_bytes(p))}): never read, "
                "delete it" for p in cut]
    return UserError(
        "out of disk space",
        f"the disk of {workdir}" + (f" ({space.size(free)} free now)" if free is not None
                                    else ""),
        "free space or point --workdir at a larger disk (checkpoints are the largest files: "
        "keep fewer with checkpoint.keep" + (f", now {keep}" if keep is not None else "")
        + ", or save the weights only with checkpoint.contents=weights)",
        details=details)


def user_error(e: BaseException, config=None, workdir: str | None = None) -> UserError | None:
    """`e` as a user error, or None when it is a bug (or unknown: kept with its traceback)."""
    if isinstance(e, UserError):
        return e
    full = out_of_disk(e, config, workdir)
    if full is not None:
        return full
    oom = out_of_memory(e, config)
    if oom is not None:
        return oom
    from lrl.checkpoint_items import CheckpointError
    if isinstance(e, CheckpointError):   # StateMismatchError is one too
        where = os.path.join(workdir, "checkpoints") if workdir else "the run's checkpoints"
        return UserError(f"cannot resume: {e}", where,
                         "start with a new --workdir, or move the named step aside (a step "
                         "moved out of checkpoints/ is not read) to resume from an older one")
    return None


def report(err: UserError, stream=None) -> None:
    stream = sys.stderr if stream is None else stream
    print(f"{PROG}: error: {err.message()}", file=stream, flush=True)


def run(fn: Callable[[], object], *, verbose: bool = False, config=None,
        workdir: str | None = None, stream=None) -> int:
    """Calls `fn()`: 0 when it returns; a user error prints its message (with `verbose`, its
    traceback first) and gives `EXIT_CODE`; any other exception propagates (a bug: its
    traceback). In a multi-process run the process then exits at once (`os._exit`), as
    `lrl.distributed`'s fail-fast hook does, so that its peers are not kept at the shutdown
    barrier."""
    try:
        fn()
        return 0
    except Exception as e:  # noqa: BLE001 -- classified below; the rest is re-raised
        err = user_error(e, config, workdir)
        if err is None:
            raise
        if verbose:
            traceback.print_exc()
        report(err, stream)
    if "jax" in sys.modules:
        import jax
        if jax.distributed.is_initialized() and jax.process_count() > 1:
            from lrl import distributed
            distributed._flush_all()   # noqa: SLF001 -- the same exit as the fail-fast hook
            os._exit(EXIT_CODE)
    return EXIT_CODE
