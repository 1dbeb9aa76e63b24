"""A module that takes a second to import (tests/test_envs.py: a worker's first call into it
spends that second loading it, which must not count against the call's time limit)."""
import time

time.sleep(1.0)


def double(x):
    return 2 * x
