"""The partial-rollout schedule on its own, simulated on the CPU in seconds: how many groups a
step trains, carries and drops as stale, for a slot count and a tail share
(`rollout.max_slots`, `rollout.partial_tail`), and a step's seconds from a cost model fitted on
an H100's measured steps. It chose `lrl.options.TAIL_SAMPLES`; a GPU run
(`experiments/bench/startup.py --runs partial`) is what measures a default.

    python experiments/bench/partial_schedule.py 128:0.5 512:0.5 512:0.125

What it follows of lrl (`lrl.collect_partial`, `lrl.rollout.partial`, the engine's scheduler):
a step first drops the carried groups whose oldest token is more than `--staleness` steps old,
draws one batch of P prompts x G samples while fewer unfinished samples than the slots (or
than a step's samples) are carried, admits the carried samples first and then the new ones
into free slots, decodes in calls of 16 steps, and stops once P groups are complete or, with
nothing waiting, fewer than tail x slots samples are live; it trains the complete groups,
oldest first, and carries the rest. Answers have the random 1.5B bench's lengths: the end token
drawn with probability 1/300 a token (mean ~300), capped at 8,192. Left out: the host's
one-call lag in refilling a slot, the tail's narrow decode programs, prefill.

The cost model, fitted on the metrics of `startup.py --runs partial,partial-s256,partial-s512`
(H100, 2026-12-06, BENCHMARKS.md "Start-up"): a decode step 2.53 ms plus 23.1 ns a KV token it
reads (at 128, 256 and 512 slots: 3.45, 4.14 and 5.22 ms a step, within 1%), the update 19.7 us
a trained token. Checked against the same runs: 128 slots, tail 0.5: 64 groups trained, none
dropped, 1,252 decode steps (measured 64, none, 1,280-1,392); 512 slots, tail 0.5: 49 trained
and 15 dropped (measured 42-59 and 10-14), 352 decode steps (352-368).
"""
from __future__ import annotations

import argparse
import math
import random

DECODE_STEP_S, KV_TOKEN_S, TRAINED_TOKEN_S = 2.53e-3, 23.1e-9, 19.7e-6
STEPS_PER_CALL = 16


def answer_length(rng: random.Random, p_end: float, cap: int) -> int:
    return min(cap, 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p_end)))


def simulate(slots: int, tail: float, *, prompts: int = 64, group: int = 8, cap: int = 8192,
             prompt_len: int = 32, staleness: int = 2, steps: int = 30, seed: int = 0,
             p_end: float = 1 / 300) -> list[dict]:
    """One run's steps, each a dict of what the step trained, dropped, carried and cost."""
    rng = random.Random(seed)
    carry, out = [], []
    for step in range(1, steps + 1):
        # a group's oldest token: the step its first sample started
        stale = [g for g in carry
                 if min((x["v0"] for x in g if x["v0"] is not None), default=step)
                 < step - staleness]
        carry = [g for g in carry if all(g is not d for d in stale)]
        unfinished = sum(x["n"] < x["L"] for g in carry for x in g)
        complete = sum(all(x["n"] >= x["L"] for x in g) for g in carry)
        pending = list(carry)
        if complete < prompts and unfinished < min(slots, prompts * group):
            pending += [[dict(L=answer_length(rng, p_end, cap), n=0, v0=None)
                         for _ in range(group)] for _ in range(prompts)]
        queue = [x for g in pending for x in g if x["n"] < x["L"]]
        live, seconds, decode_steps = [], 0.0, 0
        while True:
            while queue and len(live) < slots:
                live.append(queue.pop(0))
            if not live:
                break
            for _ in range(STEPS_PER_CALL):
                running = [x for x in live if x["n"] < x["L"]]
                seconds += DECODE_STEP_S + KV_TOKEN_S * sum(prompt_len + x["n"] for x in running)
                decode_steps += 1
                for x in running:
                    x["v0"] = step if x["v0"] is None else x["v0"]
                    x["n"] += 1
            live = [x for x in live if x["n"] < x["L"]]
            if sum(all(x["n"] >= x["L"] for x in g) for g in pending) >= prompts:
                break
            if tail and not queue and len(live) < math.ceil(tail * slots):
                break
        trained = [g for g in pending if all(x["n"] >= x["L"] for x in g)][:prompts]
        carry = [g for g in pending if all(g is not t for t in trained)]
        tokens = sum(prompt_len + x["L"] for g in trained for x in g)
        out.append(dict(trained_groups=len(trained), dropped=len(stale),
                        carried=sum(x["n"] < x["L"] for g in carry for x in g),
                        decode_steps=decode_steps, rollout_s=seconds,
                        step_s=seconds + TRAINED_TOKEN_S * tokens, tokens=tokens))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="SLOTS:TAIL, e.g. 512:0.125")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=2, help="rollout.max_staleness")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the means")
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    print("| slots | tail | trained groups a step | dropped stale | carried samples | decode "
          "steps | rollout s | step s | trained tok/s |")
    print("|" + "---|" * 9)
    for spec in a.runs:
        slots, tail = spec.split(":")
        rows = [r for seed in range(a.seeds)
                for r in simulate(int(slots), float(tail), prompts=a.prompts, group=a.group,
                                  staleness=a.staleness, steps=a.steps, seed=seed)[a.skip:]]
        mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
        print(f"| {slots} | {tail} | {mean('trained_groups'):.1f} | {mean('dropped'):.1f} | "
              f"{mean('carried'):.0f} | {mean('decode_steps'):.0f} | {mean('rollout_s'):.2f} | "
              f"{mean('step_s'):.2f} | "
              f"{sum(r['tokens'] for r in rows) / sum(r['step_s'] for r in rows):,.0f} |")


if __name__ == "__main__":
    main()
