"""The core never imports third_party/ (nor JetStream): checked on the source, with ast, so it
runs whether or not google-jetstream is installed."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = ("third_party", "jetstream")


def _imported(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module or ""


def test_core_never_imports_third_party():
    files = sorted((ROOT / "lrl").rglob("*.py"))
    assert len(files) > 50 and ROOT / "lrl" / "serve.py" in files
    bad = [f"{f.relative_to(ROOT)}: {name}" for f in files
           for name in _imported(ast.parse(f.read_text(), str(f)))
           if name.split(".")[0] in FORBIDDEN]
    assert not bad, f"the core imports third_party/JetStream: {bad}"


def test_the_scan_sees_an_import():
    tree = ast.parse("import os\nfrom third_party.jetstream import engine\nimport jetstream.core")
    assert [n for n in _imported(tree) if n.split(".")[0] in FORBIDDEN] == [
        "third_party.jetstream", "jetstream.core"]
