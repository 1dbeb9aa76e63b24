"""`python -m lrl.serve --checkpoint=DIR`: serve a trained policy through JetStream (gRPC on
localhost). The server is `third_party/jetstream/serve.py`; its docstring has the flags.

The core never imports third_party/ (DESIGN.md), so this entry point has no import of it:
it puts the repository root on sys.path (third_party/ is a folder beside lrl/, not an
installed package) and runs the adapter's module as __main__ by name, through runpy.
"""
import os
import runpy
import sys

if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    runpy.run_module("third_party.jetstream.serve", run_name="__main__", alter_sys=True)
