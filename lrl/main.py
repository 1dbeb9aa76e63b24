"""Runs one lrl experiment: `python -m lrl.main --config=configs/X.py[:arg] --workdir=DIR`.

Config fields are overridden with `--config.rl.steps=40`; the config is locked, so an unknown
key fails in one line naming the closest field. `--print_config` lists every field with its
comment; `--help` says the rest. A `--workdir` that holds a checkpoint resumes that run.
Bad input (config, paths, data, tokenizer, checkpoint, memory) is one message and exit code 2
(`lrl.errors`); `--verbosity` adds its traceback.
"""
from lrl import xla_env

xla_env.set_defaults()   # before jax is imported

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from lrl import cli  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py), optionally with ':arg'.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and plots go.")
_PRINT = flags.DEFINE_bool("print_config", False,
                           "Print the resolved config, each field with its comment, and exit.")
flags.mark_flag_as_required("config")


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {argv[1:]} (config overrides are --config.FIELD=VALUE)")
    if _PRINT.value:
        return cli.print_config(_CONFIG.value, flags.FLAGS["config"].config_filename)
    if not _WORKDIR.value:
        cli.fail("--workdir=DIR is required: where checkpoints, metrics and plots go")
    from lrl import console
    verbose = flags.FLAGS["verbosity"].present
    console.setup_logging(verbose=verbose)
    # Without --verbosity, XLA's C++ log lines go to <workdir>/xla.log (the command line's
    # process only: a caller of `run` keeps its stderr).
    return run(_CONFIG.value, _WORKDIR.value, verbose, quiet_cpp=not verbose)


def run(config, workdir: str, verbose: bool = False, quiet_cpp: bool = False) -> int:
    """`loop.run`, a user error reported in one message: the exit code (0, or 2)."""
    from lrl import console, errors, preflight

    def go():
        if quiet_cpp:
            console.hold_cpp()
        started = preflight.start(config, workdir)   # before the loop's imports: errors sooner
        if quiet_cpp:
            # XLA's C++ log lines go to <workdir>/xla.log: only once the checks passed, so a
            # refused run leaves the workdir as it was.
            console.quiet_cpp(workdir)
        from lrl import loop  # after flag parsing and the log levels, so --help stays fast
        loop.run(config, workdir, started=started)
    return errors.run(go, verbose=verbose, config=config, workdir=workdir)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
