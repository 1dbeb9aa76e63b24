"""Writes tests/golden/config_defaults.json from the code as it is (run at main before the
schema moved the fields): every config variant's fields in order with their values' reprs,
and its resolved Options' repr."""
import json, os, sys
sys.path.insert(0, os.getcwd())
from lrl import cli, config_util, options
from tests.test_configs import ARGS, CONFIGS

out = {}
for path in CONFIGS:
    name = os.path.basename(path)
    for arg in ARGS.get(name, [None]):
        c = config_util.load(path, arg)
        if c.data.source != "synthetic":
            c.data.paths = "/data/train.jsonl"
        spec = f"configs/{name}" + (f":{arg}" if arg else "")
        out[spec] = dict(fields={k: repr(v) for k, v in cli.flat_fields(c).items()},
                         options=repr(options.from_config(c, check_files=False)))
with open("tests/golden/config_defaults.json", "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print(len(out), "variants")
