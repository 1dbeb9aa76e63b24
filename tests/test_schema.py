"""Every config field is declared once, in lrl/schema.py: the configs build on its defaults,
`lrl.options` reads a config into its sections, `--print_config` and `--help` show its docs.
The golden file pins every config variant's fields and resolved options (and the step policy
derived from them) as they were before the fields moved into the schema."""
import dataclasses
import json
import os

import ml_collections
import pytest

from lrl import cli, config_util, options, schema
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


def test_every_field_and_section_has_a_one_line_doc():
    docs = schema.docs()
    assert len(docs) > 150
    assert not [path for path, doc in docs.items() if not doc.strip()]
    for f in schema.fields(schema.Config):   # a section's header: its docstring's first paragraph
        if schema.nested(f) is not None:
            head = schema.nested(f).__doc__.split("\n\n")[0]
            assert docs[f.name] == " ".join(head.split()), f.name


def _config(**changes):
    """The default config as plain data with `{"rl.group_size": "16"}` set: values of any
    type, as a config file that builds its own dicts could give."""
    d = schema.config_dict().to_dict()
    for key, value in changes.items():
        *path, name = key.split(".")
        node = d
        for p in path:
            node = node[p]
        node[name] = value
    return ml_collections.ConfigDict(d)


@pytest.mark.parametrize("key,value,match", [
    ("rl.group_size", "16", r"rl.group_size='16': expected an integer"),
    ("rl.epochs", True, r"rl.epochs=True: expected an integer"),
    ("rl.loss.clip_low", 1.0, r"rl.loss.clip_low=1.0: must be < 1"),
    ("critic.optim.lr", 0, r"critic.optim.lr=0.0: must be > 0"),
    ("rl.loss.aggregation", "sum", r"rl.loss.aggregation='sum'; choose one of"),
    ("rollout.page_sise", 16, r"config section 'rollout': unknown keys \['page_sise'\]"),
    ("rl.micro_batches", 4, r"rl.micro_batches: micro-batches are now cut by tokens"),
    ("model.tie_embeddings", 1, r"model.tie_embeddings=1: expected True or False"),
    ("rl.loss", 0.2, r"rl.loss=0.2: expected a section of fields \['clip_low'"),
])
def test_wrong_type_unknown_key_and_bound_name_the_culprit(key, value, match):
    with pytest.raises(ValueError, match=match):
        options.from_config(_config(**{key: value}), check_files=False)


def test_distributed_defaults_and_bounds_are_the_schemas():
    from lrl import distributed
    assert distributed.DEFAULTS == schema.config_dict(schema.Distributed).to_dict()
    with pytest.raises(ValueError, match=r"config.distributed.watchdog_s=-1.0: must be >= 0"):
        distributed.settings({"watchdog_s": -1.0})


def test_help_lists_every_section_with_its_header():
    text = cli.help_text()
    for f in schema.fields(schema.Config):
        if schema.nested(f) is not None:
            line = next(x for x in text.splitlines() if x.split()[:1] == [f.name])
            assert schema.docs()[f.name] in line


def test_a_field_added_to_a_section_is_defaulted_checked_and_printed(monkeypatch):
    """What docs/config.md says a new field needs: one line in its section, nothing else."""
    rollout = dataclasses.make_dataclass(
        "Rollout", [("max_turns", int, schema.field(1, "turns of an episode", ge=1))],
        bases=(schema.Rollout,), frozen=True)
    config = dataclasses.make_dataclass(
        "Config", [("rollout", rollout, schema.section(rollout, "the rollout engine"))],
        bases=(schema.Config,), frozen=True)
    monkeypatch.setattr(schema, "Config", config)
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    assert c.rollout.max_turns == 1 and c.rollout.page_size == 16
    assert options.from_config(c, check_files=False).rollout.max_turns == 1
    line = next(x for x in cli.config_listing(c, "configs/default.py")
                if x.startswith("rollout.max_turns = 1"))
    assert line.endswith("# turns of an episode")
    c.rollout.max_turns = 0
    with pytest.raises(ValueError, match=r"rollout.max_turns=0: must be >= 1"):
        options.from_config(c, check_files=False)
    del c.rollout["max_turns"]   # a config from before the field: named, not a KeyError
    with pytest.raises(ValueError, match=r"config section 'rollout'.*missing keys \['max_turns'\]"):
        options.from_config(c, check_files=False)
