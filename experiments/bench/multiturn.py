"""Multi-turn rollouts with tools that take time: the scheduler's continuous batching across
turns (`lrl.rollout.turns`: a sample waiting on its tool leaves its decode row, keeps its KV
pages, and comes back with its observation prefilled after them) against a turn-by-turn
baseline on the same engine, where the whole batch waits on each turn's tools (turn t of
every trajectory, then all the tools, then turn t + 1).

On one H200 (Qwen2.5-1.5B shapes, random bf16 weights, temperature-1 sampling):
    python experiments/bench/multiturn.py
On CPU, a tiny model and a few trajectories, to check the script itself:
    python experiments/bench/multiturn.py --smoke

N trajectories (one sample of each of N prompts of T tokens) of K model turns each, every
turn forced to a length drawn uniformly from [--turn-min, --turn-max] (`Request.max_turn_fn`:
random weights never draw an end token), each turn followed by a tool that sleeps --latency
seconds in a thread and returns --obs tokens (after the K-th it ends the trajectory). The
continuous mode runs twice: in `Policy.turn_order`'s default (new trajectories, then the
laggards, first) and in "arrival" order (resumed samples first, as they came). Every mode
samples the same tokens (draws keyed by sample and step). The first run (continuous, the
first latency) compiles; every program is compiled by then, and the runs after it must
compile nothing (counted, printed). Reported per mode and latency: wall seconds, generated
(model) tokens per second, the slot occupancy (the share of the decode steps' rows that
sampled a token), the share of the wall time the scheduler blocked on tools with nothing to
decode, and the speed-up over the baseline; with latency 0 among them, the ceiling: the
continuous run with instant tools over the baseline at each latency.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from anywhere
from experiments.bench.rollout import model_config  # noqa: E402  (the rollout bench's shapes)


class Tools:
    """The `Turns` of the bench: after a trajectory's turn its tool sleeps `latency` in a
    thread, then answers --obs fixed tokens (None after the K-th turn). `barrier`: the
    turn-by-turn baseline: the tools of a turn start once every trajectory still going has
    ended that turn, and all their answers come back together when the last is done."""

    def __init__(self, n: int, turns: int, obs: np.ndarray, latency: float, barrier: bool):
        self.turns, self.obs, self.latency, self.barrier = turns, obs, latency, barrier
        self.done = collections.Counter()
        self.going, self.held = n, []
        self.answers: queue.Queue = queue.Queue()
        self.pool = ThreadPoolExecutor(max_workers=min(n, 1024))

    def turn_ended(self, key, tokens, room, cut):
        self.done[key] += 1
        answer = None if self.done[key] >= self.turns else self.obs[:room]
        if not self.barrier:
            self.pool.submit(self._tool, key, answer)
            return
        self.held.append((key, answer))
        if len(self.held) == self.going:   # every trajectory still going ended this turn
            batch, self.held = self.held, []
            self.going -= sum(a is None for _, a in batch)
            threading.Thread(target=self._all_tools, args=(batch,), daemon=True).start()

    def _tool(self, key, answer):
        time.sleep(self.latency)
        self.answers.put((key, answer))

    def _all_tools(self, batch):
        wait([self.pool.submit(time.sleep, self.latency) for _ in batch])
        for x in batch:
            self.answers.put(x)

    def ready(self, block):
        out = [self.answers.get()] if block else []
        while True:
            try:
                out.append(self.answers.get_nowait())
            except queue.Empty:
                return out

    def close(self):
        self.pool.shutdown(wait=True)


def build(a, cfg):
    """The engine (one for every run), the prompts, the turn lengths and the observation."""
    from lrl import rollout
    from lrl.rollout.pages import pages_for
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size, size=a.prompt) for _ in range(a.n)]
    lengths = rng.randint(a.turn_min, a.turn_max + 1, size=(a.n, a.turns))
    obs = rng.randint(0, cfg.vocab_size, size=a.obs).astype(np.int32)
    limit = a.turns * (a.turn_max + a.obs) + 1
    ps = 16
    ecfg = rollout.engine_config(
        cfg, max_prompt_len=a.prompt, max_new_tokens=limit, max_slots=a.slots,
        num_pages=a.n * pages_for(a.prompt + limit, ps) + 8 * a.slots + 1,
        max_prompts=a.n, page_size=ps, sampling=rollout.SamplingParams(1.0),
        turn_prefill_tokens=a.turn_prefill_tokens,
        **({"extend_block_pages": a.extend_block_pages} if a.extend_block_pages else {}),
        **({"prefill_chunk": 64} if a.smoke else {}))
    return rollout.Engine(cfg, ecfg), prompts, lengths, obs, limit


def run_once(engine, dparams, params, prompts, lengths, obs, limit, a, latency, barrier,
             order="least_progress"):
    from lrl import rollout
    from lrl.rollout import scheduler
    tools = Tools(len(prompts), a.turns, obs, latency, barrier)
    request = rollout.Request(prompts, limit, 1, seed=0, sampling=rollout.SamplingParams(1.0),
                              turns=tools,
                              max_turn_fn=lambda sid, t: int(lengths[sid, t]))
    stats = {}
    t0 = time.perf_counter()
    result = scheduler.run(engine, params, request, decode_params=dparams, stats=stats,
                           policy=rollout.Policy(steps_per_call=a.steps_per_call,
                                                 turn_order=order))
    wall = time.perf_counter() - t0
    tools.close()
    model = sum(int(m.sum()) for per in result.model_masks for m in per)
    if model != int(lengths.sum()) or stats["turns"] != a.turns * len(prompts):
        raise RuntimeError(f"the trajectories did not run as forced: {model} model tokens, "
                           f"{stats['turns']} turns")
    mode = "turn by turn" if barrier else (
        "continuous" if order == "least_progress" else f"continuous, {order} order")
    return dict(mode=mode, latency_ms=latency * 1e3,
                wall_s=wall, model_tokens=model, tok_s=model / wall,
                occupancy=stats["slot_occupancy"],
                occupancy_waiting=stats["occupancy_waiting"],
                blocked=stats.get("blocked_s", 0.0) / wall, decode_steps=stats["decode_steps"],
                prefill_s=stats["prefill_s"], observed=stats["observed_tokens"],
                prefill_rounds=stats.get("prefill_rounds", 0),
                extend_calls=stats.get("extend_calls", 0),
                refilled=stats.get("refilled", 0), preempted=stats.get("preempted", 0),
                # where the wall time went: the prefill rounds split into the prompts' and
                # the observations' calls, the decode calls (from the first to the last
                # collection, less the prefills timed in between) and the host's own work
                **{k: stats.get(k, 0) for k in (
                    "prefill_prompts_s", "prefill_observations_s", "prompt_rounds",
                    "prompts_prefilled", "decode_s", "decode_calls", "host_admit_s",
                    "host_grow_s", "host_collect_s")})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, few trajectories (CPU)")
    ap.add_argument("--n", type=int, default=None, help="trajectories (default 512; smoke 8)")
    ap.add_argument("--slots", type=int, default=None, help="decode slots (default 256; 4)")
    ap.add_argument("--turns", type=int, default=None, help="model turns each (default 6; 3)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; 8)")
    ap.add_argument("--turn-min", type=int, default=None, help="shortest turn (default 16; 2)")
    ap.add_argument("--turn-max", type=int, default=None, help="longest turn (default 128; 8)")
    ap.add_argument("--obs", type=int, default=None, help="observation tokens (default 48; 4)")
    ap.add_argument("--latencies", default="0,0.02,0.2",
                    help="tool seconds, comma-separated (0: instant tools, the ceiling)")
    ap.add_argument("--steps-per-call", type=int, default=16)
    ap.add_argument("--turn-prefill-tokens", type=int, default=1024,
                    help="EngineConfig.turn_prefill_tokens: an observation-prefill call's tokens")
    ap.add_argument("--extend-block-pages", type=int, default=0,
                    help="EngineConfig.extend_block_pages (0: the engine's default)")
    return ap


def settings(argv):
    a = parser().parse_args(argv)
    big, small = dict(n=512, slots=256, turns=6, prompt=256, turn_min=16, turn_max=128,
                      obs=48), dict(n=8, slots=4, turns=3, prompt=8, turn_min=2, turn_max=8,
                                    obs=4)
    for k, v in (small if a.smoke else big).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.smoke:
        a.steps_per_call = min(a.steps_per_call, 4)
    return a


def main():
    a = settings(sys.argv[1:])
    import jax
    from lrl import compiles
    from lrl.models import init_params
    cfg = model_config(a.smoke)
    params = init_params(cfg, jax.random.key(0))
    engine, prompts, lengths, obs, limit = build(a, cfg)
    dparams = engine.decode_params(params)
    # Every program up front (the loop's engine does the same): the prompt prefill's shapes,
    # the decode widths and the observation prefill's row counts, which one run may not all
    # reach.
    state = engine.compile_prefill(dparams, engine.take_state())
    state = engine.compile_decode(dparams, state, a.steps_per_call)
    state = engine.compile_extend(dparams, state, [a.obs])
    # What one observation-prefill call costs on its own: the quarter and the full program
    # (C of an observation of --obs tokens), run on empty rows, as compile_extend runs them.
    jax.block_until_ready(state.k_pages)
    t0, reps = time.perf_counter(), 10
    for _ in range(reps):
        state = engine.compile_extend(dparams, state, [a.obs])
    jax.block_until_ready(state.k_pages)
    pair_ms = (time.perf_counter() - t0) / reps * 1e3
    engine.keep_state(state)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"{cfg.num_params() / 1e9:.3f}B params; {a.n} trajectories x {a.turns} turns of "
          f"{a.turn_min}-{a.turn_max} tokens, {a.obs}-token observations, {a.slots} slots",
          flush=True)
    C = engine.extend_chunk(a.obs + 1)
    print(f"one observation-prefill call of each of its two programs (C {C}, R "
          f"{engine._extend_rows(C, 1)} and {engine._extend_rows(C, 1 << 30)}): "
          f"{pair_ms:.2f} ms the pair", flush=True)
    latencies = [float(x) for x in a.latencies.split(",") if x]
    compiles.install()
    t0 = time.perf_counter()
    rows = [run_once(engine, dparams, params, prompts, lengths, obs, limit, a, latencies[0],
                     False)]
    rows[0]["first_run"] = True
    print(json.dumps(rows[0]), f"(first run, compiles included: {time.perf_counter() - t0:.1f} "
                               f"s)", flush=True)
    before = compiles.snapshot()
    runs = [(False, "least_progress"), (False, "arrival"), (True, "least_progress")]
    for latency in latencies:
        for barrier, order in runs:
            r = run_once(engine, dparams, params, prompts, lengths, obs, limit, a, latency,
                         barrier, order)
            print(json.dumps(r), flush=True)
            rows.append(r)
    new = compiles.since(before)
    print(f"\ncompiles after the first run: {sum(new.values())} {new or ''}")
    print("\n| tool latency | mode | wall s | generated tok/s | slot occupancy | blocked on "
          "tools | × turn by turn | prefill s | rounds | calls |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for latency in latencies:
        pair = [r for r in rows[1:] if r["latency_ms"] == latency * 1e3]
        base = next(r for r in pair if r["mode"] == "turn by turn")
        for r in pair:
            print(f"| {r['latency_ms']:.0f} ms | {r['mode']} | {r['wall_s']:.2f} | "
                  f"{r['tok_s']:.0f} | {r['occupancy']:.0%} | {r['blocked']:.0%} | "
                  f"{r['tok_s'] / base['tok_s']:.2f} | {r['prefill_s']:.2f} | "
                  f"{r['prefill_rounds']} | {r['extend_calls']} |")
    # A schedule that hides the tools' latency does at best what the same engine does with
    # tools that take no time: the continuous run at latency 0 is the ceiling of every
    # latency's speed-up (up to the scheduler's choices, which instant tools also change).
    free = next((r for r in rows[1:] if r["latency_ms"] == 0 and r["mode"] == "continuous"),
                None)
    if free is not None:
        for latency in latencies:
            base = next(r for r in rows[1:] if r["latency_ms"] == latency * 1e3
                        and r["mode"] == "turn by turn")
            print(f"ceiling at {latency * 1e3:.0f} ms: continuous with instant tools / turn by "
                  f"turn = {free['tok_s'] / base['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
