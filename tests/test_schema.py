"""Every config field is declared once, in lrl/schema.py: the configs build on its defaults,
`lrl.options` reads a config into its sections, `--print_config` and `--help` show its docs.
The golden file pins every config variant's fields and resolved options (and the step policy
derived from them) as they were before the fields moved into the schema."""
import json
import os

import pytest

from lrl import cli, config_util, options
from tests.golden import make_config_defaults as golden
from tests.test_configs import ARGS, CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "tests", "golden", "config_defaults.json")) as f:
    GOLDEN = json.load(f)
VARIANTS = [(path, arg) for path in CONFIGS for arg in ARGS.get(os.path.basename(path), [None])]


def _spec(path, arg):
    return f"configs/{os.path.basename(path)}" + (f":{arg}" if arg else "")


def test_the_golden_file_covers_every_config_variant():
    assert sorted(GOLDEN) == sorted(_spec(p, a) for p, a in VARIANTS)


@pytest.mark.parametrize("path,arg", VARIANTS, ids=lambda x: os.path.basename(str(x)))
def test_fields_and_resolved_options_are_as_before_the_schema(path, arg):
    want = GOLDEN[_spec(path, arg)]
    c = config_util.load(path, arg)
    if c.data.source != "synthetic":
        c.data.paths = "/data/train.jsonl"
    fields = {k: repr(v) for k, v in cli.flat_fields(c).items()}
    assert fields == want["fields"]
    assert golden.resolved(options.from_config(c, check_files=False)) == want["options"]
