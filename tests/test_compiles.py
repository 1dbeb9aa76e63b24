"""Ten GRPO steps whose prompt and response lengths vary widely compile every program of the
rollout and of the update once, and all in the first step: a step's lengths change how many
calls it makes (micro-batches of each shape, prefill calls, decode calls), never a shape."""
import dataclasses
import os

import numpy as np
import pytest

from lrl import build, compiles, config_util, grpo, loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each compiled once for the run (the decode program once per sampling setting: the held-out
# eval samples at the training temperature here) ...
PROGRAMS = ("jit(_start)", "jit(_apply)", "jit(insert_slots)", "jit(deactivate)",
            "jit(_refresh)")
# The packed prefill twice, with the engine: calls of every row and the narrow ones that
# admit a prompt or two (`EngineConfig.prefill_narrow_rows`).
PREFILL = "jit(prefill_packed)"
# The decode programs, at most once each: all 128 slots, and the tail's 32 rows
# (`EngineConfig.narrow_widths`), which hold every call when no more samples than that run.
DECODE = ("jit(decode_steps)", "jit(decode_rows)")
# ... and these once per micro-batch shape: [shards x rows_per_shard, T], and [shards, T'] for
# T' each of the row lengths a minibatch's last rows are cut to (`budget.row_lengths`: T, T/2
# here), every one in the first step, whichever a step's rows need.
PER_SHAPE = ("jit(_accumulate)", "jit(logprobs)")
SHAPES = 3


@pytest.mark.slow
def test_ten_steps_of_varied_lengths_compile_each_program_once(tmp_path, monkeypatch):
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.model.update(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64)
    c.tokenizer.vocab_size = 320
    c.mesh.update(fsdp=4, tensor=2)
    c.data.update(task="kv_retrieval", max_prompt_len=104)
    c.data.task_kwargs.kv_retrieval.update(num_pairs=6, min_pairs=1)   # prompts of ~20-90
    c.sft.steps = 0
    # One minibatch a step, so that over 4 shards its last rows need rows of 256 or of 128
    # as its lengths go; two epochs need the trainer's old log-probs, which compile the
    # log-prob pass's shapes.
    c.rl.update(steps=10, prompts_per_step=4, group_size=4, max_new_tokens=24, row_len=256,
                max_tokens_per_micro=512, minibatches=1, epochs=2, recompute_old_logp=True,
                temperature=0.9)
    c.eval.update(every=5, num_prompts=4, k=2, temperature=0.9)
    c.data.eval_size = 4
    c.checkpoint.every_steps = 0
    c.metrics.tensorboard = False
    rng = np.random.default_rng(0)
    forced = []

    def with_varied_lengths(*args):
        # A random policy never ends by itself: force each sample's end at 1..24 tokens.
        def length(sample_id):
            n = int(rng.integers(1, 25))
            forced.append(n)
            return n
        s, live = build.grpo(*args)
        return dataclasses.replace(s, max_new_fn=length), live

    shapes, updates = [], grpo.updates

    def recording(s, state, batches):   # the shapes each step's rows needed
        shapes.append(sorted(mb["tokens"].shape for b in batches for mb in b.micro))
        return updates(s, state, batches)

    monkeypatch.setattr(grpo, "updates", recording)
    before = compiles.snapshot()
    loop.run(c, str(tmp_path), build=with_varied_lengths)
    counts = compiles.since(before)
    import json
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "compiles/step" in r]
    assert len(steps) == 10 and min(forced) <= 3 and max(forced) >= 22
    lengths = [r["response/length_mean"] for r in steps]
    assert max(lengths) - min(lengths) > 2                 # the steps' lengths did vary
    # The steps' rows needed different shapes (never the K-row one, compiled all the same in
    # the first step: `grpo.warm_up`).
    assert len({tuple(x) for x in shapes}) > 1
    assert set(sum(shapes, [])) == {(4, 256), (4, 128)}
    assert [r["compiles/step"] for r in steps[1:]] == [0] * 9, [r["compiles/step"] for r in steps]
    for name in PROGRAMS:
        assert counts.get(name) == 1, (name, {k: v for k, v in counts.items() if v > 1})
    assert counts.get(PREFILL) == 2, counts.get(PREFILL)
    assert {counts.get(name, 0) for name in DECODE} <= {0, 1} and \
        sum(counts.get(name, 0) for name in DECODE) >= 1, counts
    for name in PER_SHAPE:
        assert counts.get(name) == SHAPES, (name, counts.get(name))
