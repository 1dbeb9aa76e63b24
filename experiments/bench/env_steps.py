"""What an environment step costs the rollout on the host: `lrl.envs.Driver` steps of the
"tools" environment (a `calc` call each, rendered with the embedded tokenizer's template), in
process and in reward workers, as steps per second and the latency of one step (from
`turn_ended` to its observation's ids in `ready`).

    python -m experiments.bench.env_steps            # 400 steps per setting
    python -m experiments.bench.env_steps --smoke    # 40

CPU only: the number bounds how many tool turns per second the driver can feed the engine
(one worker process per step at a time; the environment is pickled there and back).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from lrl import envs, rewards
from lrl.data.synthetic import synthetic_corpus
from lrl.data.tokenizer import build_tokenizer

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "48213 * 9127"}}</tool_call>'


def run(driver, tok, n_steps: int, in_flight: int) -> dict:
    """n_steps steps, at most `in_flight` waiting at once (as many samples on tools)."""
    turn = np.array(tok.encode(CALL, add_special_tokens=False), np.int32)
    started, lat, done, key = {}, [], 0, 0
    t0 = time.perf_counter()
    while done < n_steps:
        while len(started) < in_flight and key < n_steps:
            started[(0, key)] = time.perf_counter()
            driver.turn_ended((0, key), turn, 10_000, False)
            key += 1
        for k, ids in driver.ready(block=True):
            assert ids is not None and len(ids) > 0
            lat.append(time.perf_counter() - started.pop(k))
            done += 1
    wall = time.perf_counter() - t0
    return {"steps_per_s": n_steps / wall, "latency_ms_p50": 1e3 * float(np.median(lat)),
            "latency_ms_p90": 1e3 * float(np.percentile(lat, 90))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--smoke", action="store_true", help="40 steps per setting")
    args = ap.parse_args()
    n = 40 if args.smoke else args.steps
    tok = build_tokenizer(synthetic_corpus(200), 300)
    rows = [{"answer": "1"}]
    out = {}
    for name, workers, in_flight in (("in_process", None, 1), ("workers_1", 1, 1),
                                     ("workers_2", 2, 8)):
        pool = None if workers is None else rewards.RewardPool(
            "exact", num_workers=workers, timeout_s=10.0, fail_patience=0)
        try:
            if pool is not None:   # start the workers before timing
                pool.score([("1", "1")] * workers)
            driver = envs.Driver("tools", rows, tok, pool=pool, max_turns=10_000)
            out[name] = run(driver, tok, n, in_flight)
        finally:
            if pool is not None:
                pool.close()
        print(name, json.dumps({k: round(v, 2) for k, v in out[name].items()}), flush=True)


if __name__ == "__main__":
    main()
