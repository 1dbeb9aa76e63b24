"""Runs one lrl experiment: `python -m lrl.main --config=configs/X.py[:arg] --workdir=DIR`.

Config fields are overridden with `--config.rl.group_size=16`; the config is locked, so an
unknown key fails with its name. A `--workdir` that holds a checkpoint resumes that run.
"""
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py), optionally with ':arg'.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and plots go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from lrl import console
    console.setup_logging(verbose=flags.FLAGS["verbosity"].present)
    from lrl import loop  # after flag parsing and the log levels, so --help stays fast
    loop.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
