"""The whole GRPO step as a user runs it: `lrl.loop.run` (the code `python -m lrl.main` runs)
for N steps at a real model's shapes, random weights, with a controlled response length.

    python experiments/bench/grpo_step.py --case long --steps 4     # H200: mean 4K, cap 16K
    python experiments/bench/grpo_step.py --case short --steps 10   # cap 1K
    python experiments/bench/grpo_step.py --case qwen2_5_math:7b --steps 3 --prompts 8 \
        --mean 1024 --cap 2048                       # 7B, bf16 masters (one H200)
    python experiments/bench/grpo_step.py --case short --steps 8 --partial --partial-tokens 0
                                                        # partial rollouts, stopped in the tail
    python experiments/bench/grpo_step.py --case video_qa --steps 3 --frames 64
        # Qwen2.5-VL-7B (its vision tower's shapes), bf16 masters, one H200: 16 prompts x 8 of
        # 64 frames (8192 visual tokens), answers mean 512 cap 2048, 128 slots
    python experiments/bench/grpo_step.py --case long_context_ring --steps 3 --prompt 16384
        # Qwen2.5-7B, bf16 masters, one H200: 8 prompts x 8 of ~15K tokens (not ~120K),
        # answers mean 2048 cap 8192, 64 slots
    python experiments/bench/grpo_step.py --case short --steps 6 --partial --profile-step 5
        # ... and how step 5 used the device: busy share, time per program, idle gaps
    python experiments/bench/grpo_step.py --smoke                   # CPU, tiny, checks it runs
    python experiments/bench/grpo_step.py --smoke --case video_qa   # (or long_context_ring)
    python experiments/bench/grpo_step.py --case long --steps 4 --estimator gae
        # PPO's step: a critic (the policy's decoder with a value head) on the same device,
        # its old values in the log-prob pass, GAE, its update before the actor's (the
        # table's FLOPs count the actor's alone; the critic's time is in the host column and
        # in metrics.jsonl's time/critic_s)

The one thing the benchmark adds to the loop: each sample's end is forced at a length drawn
from a log-normal (sigma 1, mean `--mean` before the cap at `--cap`), since random weights
never end by themselves; one draw a sample, keyed by its prompt and index, so a sample carried
over steps (`--partial`) keeps its length. The tokenizer is a stand-in (the synthetic task's,
with the vocabulary padded to the model's 151,936 ids, 152,064 for 7B: sampled ids past it
decode to nothing), the prompts are the synthetic arithmetic task's, the reward is a coin flip
(so groups have advantages).

The real-model configs run at their own shapes on one device, as what one GPU holds caps
them: the mesh is one device (fsdp=-1, seq=1, dense attention: the configs' ring needs
seq > 1), 7B masters are bf16, the lm head's log-prob chunk 2048.
- `video_qa` (configs/video_qa.py: Qwen2.5-VL-7B for 8 GPUs, fsdp=2 x seq=4 ring): the
  synthetic video task's prompts (configs/video_synthetic.py, its videos written into the
  workdir) instead of a jsonl, at the config's largest frame (256 merged tokens), --frames
  frames a video (the config's 64), the config's shared prompt (auto), row length and
  minibatches; the vision tower at Qwen2.5-VL-7B's shapes, random (lrl's window and
  full-attention blocks, not the checkpoint's: `VL_7B`).
- `long_context_ring` (configs/long_context_ring.py: Qwen2.5-7B on 128K rows, ring over 8
  GPUs): the synthetic key-value retrieval task's prompts of about 85-95% of --prompt
  tokens (16384), the config's answer cap (8192), 8 prompts x 8 and 64 slots.

Per step it prints rollout / log-prob / update / host seconds, pack fill, compiles so far,
trained tokens per second per GPU, whole-step MFU and the composition ratio:
- FLOPs = 6 N (trained tokens) + 2 N (generated tokens) + 2 (N - V D) (prefilled tokens, no
  logits) + attention (6 L D_att sum(len^2) in the update, causal, less (G - 1) prompt^2 a
  group whose rows hold its prompt once, `rl.shared_prompt`; 4 L D_att per generated token
  per token of its context in decode; 2 L D_att prompt^2 a prompt in prefill, at the mean
  prompt length), N = the text decoder's matmul parameters (non-embedding + the lm head),
  over step time x --peak-tflops (791, the H200's measured bf16 matmul rate). The video
  case's vision tower is left out (frozen, forward only: about 5% of its step's FLOPs at 64
  frames), and its time (`time/vision_s`) is in the host column;
- the prediction the composition ratio divides by the step time: decode at the rollout
  bench's rate (`rollout.py`'s `bench_case`, run in this process after the loop) for full
  slots at the run's mean context, prefill at --prefill-mfu, the update at the update bench's
  MFU (`train_step.py`'s `measure`, also run here after the loop) for one row of the run's
  row length: what the parts' benchmarks give for the same tokens, with no tail and no host
  gap. The table also gives the ratio with decode at --decode-frac of the
  HBM roofline (50%, the rollout bench's rate at 256 slots of 640 tokens), the prediction
  before the bench ran here; --decode-ms sets the bench's rate instead of measuring it.

B batch rows (the engine's slots) · L layers · D model width · V vocabulary.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# This folder's profile.py would shadow the standard library's (torch imports cProfile).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
from lrl import xla_env  # noqa: E402

# As `python -m lrl.main`: the device's memory and (offloaded optimizers) the host's. Without
# the host's, the 7B run with fp32 masters stopped placing them at jax's 64 GB cap.
xla_env.set_defaults()

# Model shapes of the configs' models (random weights here), with their vocabularies.
SHAPES = {
    "1.5b": dict(model_type="qwen2", d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                 head_dim=128, mlp_dim=8960, rope_theta=1e6, tie_embeddings=True,
                 vocab_size=151936),
    "7b": dict(model_type="qwen2", d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
               head_dim=128, mlp_dim=18944, rope_theta=1e6, tie_embeddings=False,
               vocab_size=152064),
    "tiny": dict(model_type="qwen2", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                 head_dim=16, mlp_dim=128, rope_theta=1e4, tie_embeddings=True,
                 vocab_size=512),
}
# Qwen2.5-VL-7B's vision tower and M-RoPE sections (its config.json). The random tower keeps
# lrl's window (56 px) and full attention in block 0 only, where the checkpoint's has 112 px
# windows and full attention in blocks 7, 15, 23 and 31 (`lrl.tasks.video.policy_config`).
VL_7B = dict(vision_depth=32, vision_width=1280, vision_heads=16, vision_mlp_dim=3420,
             mrope_section=(16, 24, 24))
# The cases' defaults beside the generic ones (mean and cap of the responses, prompts a step,
# engine slots, prompt tokens): the real-model configs' own sizes where one H200 holds them.
GENERIC = dict(mean=4096, cap=16384, prompts=32, slots=256, prompt=256)
DEFAULTS = {
    "short": dict(mean=300, cap=1024),
    "long": dict(mean=4096, cap=16384),
    # multiple-choice answers are short; the config's 2048 cap and 16 prompts x 8, 128 slots
    "video_qa": dict(mean=512, cap=2048, prompts=16, slots=128),
    # the config's 8192 cap and 8 prompts x 8, 64 slots; prompts of ~16K, not ~120K, tokens
    "long_context_ring": dict(mean=2048, cap=8192, prompts=8, slots=64, prompt=16384),
}
SMOKE = dict(mean=12, cap=24, prompts=4, group=2, slots=8, steps=3, prompt=64,
             prefill_tokens=256, chunk=128, frames=4)


def case_name(a) -> str:
    """The config a case runs: qwen2_5_math (long, short, --smoke), or CONFIG of CONFIG[:ARG]."""
    name = a.case.partition(":")[0]
    if a.case in ("long", "short") or (a.smoke and name not in ("video_qa",
                                                                 "long_context_ring")):
        return "qwen2_5_math"
    return name


def make_config(a):
    from lrl import config_util
    name = case_name(a)
    if name == "qwen2_5_math" and (a.smoke or a.case in ("long", "short")):
        c = config_util.load(os.path.join(ROOT, "configs", "qwen2_5_math.py"), "1.5b")
        shape = "tiny" if a.smoke else "1.5b"
    else:
        arg = a.case.partition(":")[2]
        c = config_util.load(os.path.join(ROOT, "configs", name + ".py"), arg or None)
        shape = "tiny" if a.smoke else ("7b" if "7b" in a.case or name in (
            "long_context_ring", "video_qa") else "1.5b")
    video = c.task == "video"
    c.model.update(hf_path="", **SHAPES[shape])
    if a.smoke:
        c.model.update(dtype="float32", remat="none")
    if a.param_dtype:
        c.model.param_dtype = a.param_dtype
    elif shape == "7b":
        # bf16 masters, as the recorded 7B rows ran (61 GB of state on the device).
        # `--param-dtype float32` runs the shipped fp32 masters: 122 GB with their moments and
        # gradients, so `optim.offload="auto"` puts masters and moments in host memory.
        c.model.param_dtype = "bfloat16"
    if video:
        _video_data(c, a)
    else:
        c.tokenizer.update(path="", vocab_size=300)
        c.data.update(source="synthetic", task="arithmetic", paths="", eval_paths="",
                      max_prompt_len=a.prompt, system_prompt="")
    if name == "long_context_ring":
        # Key-value retrieval prompts of about 85-95% of --prompt tokens (none dropped): a
        # "key: value" line is about 9.9 tokens of the local tokenizer, the header and chat
        # template about 60 (measured at 16384: 13.9K-15.3K, mean 14.7K).
        pairs = max(1, (a.prompt - 64) * 2 // 21)
        c.data.task = "kv_retrieval"
        c.data.task_kwargs.kv_retrieval.update(num_pairs=pairs, min_pairs=max(1, pairs * 9 // 10),
                                               key_len=3, value_len=4)
    c.mesh.update(data=1, fsdp=-1, seq=1, tensor=1)
    # One device: dense attention (ring and Ulysses split rows over seq > 1).
    c.model.update(attention="dense", param_shard_axes="fsdp")
    cap = a.cap
    c.rl.update(steps=a.steps, prompts_per_step=a.prompts, group_size=a.group,
                max_new_tokens=cap, dynamic_sampling=False, overlong="none",
                recompute_old_logp=a.recompute_old_logp,
                # The lm head's chunk holds [C, V] fp32 logits and softmax and their bf16
                # gradient: at V = 151,936 and C = 8K about 12 GB, that 7B's update cannot spare
                # beside its state on one H200 (2K: 3 GB); 1.5B was measured at 8K.
                logprob_chunk=a.chunk or (2048 if shape == "7b" else 8192),
                row_len=_video_row_len(c, a) if video else 0, max_tokens_per_micro=a.budget)
    if a.estimator:   # e.g. gae: PPO with a critic (lrl/ppo.py), no critic warm-up
        c.rl.estimator = a.estimator
    c.reward.update(spec="bench_coin:1.0", num_workers=0)
    c.rollout.update(max_slots=a.slots, pool_tokens=0, pool_fraction=a.pool_fraction,
                     prefill_tokens=a.prefill_tokens, sp_min_tokens=0,
                     narrow_decode=not a.no_narrow, partial=a.partial,
                     partial_tokens=a.partial_tokens if a.partial else 0,
                     partial_tail=a.partial_tail if a.partial else 0.0,
                     max_staleness=a.max_staleness)
    c.eval.every = 0
    c.checkpoint.update(every_steps=0, every_minutes=0.0)
    c.metrics.update(tensorboard=False, samples_per_step=0)
    c.optim.update(warmup_steps=1)
    for item in a.set:
        key, sep, value = item.partition("=")
        *path, leaf = key.split(".")
        node = c
        for part in path:
            node = node[part]
        if not sep or leaf not in node:
            raise SystemExit(f"--set {item!r}: not KEY=VALUE for a key of the config")
        old = node[leaf]
        node[leaf] = type(old)(value) if not isinstance(old, bool) else value in ("1", "true",
                                                                                   "True")
    return c


def _video_data(c, a) -> None:
    """The synthetic video task's prompts (configs/video_synthetic.py: videos written into
    the workdir) in place of the config's jsonl: --frames frames sampled a video at the
    config's largest frame (16 x 16 merged tokens: 448 px squares; the files hold at most 32
    frames, sampled with repeats, so the shapes' motion fits the frame), one video a prompt
    of each step (every step encodes its own), Qwen2.5-VL-7B's vision tower."""
    v = c.video
    if a.smoke:   # configs/video_qa.py:runlocal's frames
        v.update(min_tokens_per_frame=4, max_tokens_per_frame=16)
    else:
        v.update(**VL_7B)
    v.update(num_frames=a.frames, frames_in_file=min(a.frames, 32),
             frame=28 * math.isqrt(v.max_tokens_per_frame), cache_dir="")
    c.data.update(source="synthetic", task="direction", paths="", eval_paths="",
                  size=a.prompts * a.steps, eval_size=2, system_prompt="")


def _video_row_len(c, a) -> int:
    """An update row holds a prompt (its visual tokens and under 256 of text) and a response
    at the cap: the config's row length, or more for more frames."""
    v = c.video
    visual = a.frames // 2 * v.max_tokens_per_frame      # 2 frames a temporal patch
    unit = 128 if a.smoke else 1024
    need = -(-(visual + 256 + a.cap) // unit) * unit
    return need if a.smoke else max(c.rl.row_len, need)


def lengths_fn(mean: float, cap: int, seed: int):
    """Forced response lengths: log-normal with sigma 1 and `mean` before the cap, one draw a
    sample, from its key (its prompt and its index in the group), so that a sample carried
    over steps (`--partial`) keeps its length."""
    mu = math.log(mean) - 0.5

    def length(key: tuple) -> int:
        prompt, g = key
        rng = random.Random(zlib.crc32(prompt) * 1_000_003 + g * 7919 + seed)
        return max(1, min(cap, int(rng.lognormvariate(mu, 1.0))))
    return length


def matmul_params(cfg) -> int:
    """N of the FLOP count: the text decoder's parameters less the input embedding (a
    lookup), the lm head counted (tied or not)."""
    embed = cfg.vocab_size * cfg.d_model
    return cfg.num_params() - embed * (1 if cfg.tie_embeddings else 2) + embed


def flops_and_prediction(row, cfg, a, decode_step_s=None):
    """(whole-step FLOPs, the parts' predicted seconds, their decode seconds) for one step's
    metrics row: decode at `decode_step_s` a step of full slots, else at --decode-frac of the
    HBM roofline."""
    from lrl.rollout.pages import kv_bytes_per_token
    D_att = cfg.n_heads * cfg.head_dim
    embed = cfg.vocab_size * cfg.d_model
    N = matmul_params(cfg)
    trained = row["pack/tokens"]
    generated = row["rollout/new_tokens"]
    prefilled = row["rollout/prefill_tokens"]
    ctx = row["rollout/kv_token_steps"]            # sum over generated tokens of their context
    L = cfg.n_layers
    groups = row.get("partial/trained_groups", a.prompts)
    prompt_len = prefilled / max(a.prompts, 1)     # each group's prompt is prefilled once
    # pack/seq_len_sq sums (prompt + response)^2 over the samples; a row that holds a group's
    # prompt once (rl.shared_prompt) computes (G - 1) prompt^2 fewer causal pairs a group.
    shared = row.get("pack/shared_frac", 0.0) * groups * (a.group - 1) * prompt_len ** 2
    update_f = 6 * N * trained + 6 * L * D_att * (row["pack/seq_len_sq"] - shared)
    decode_f = 2 * N * generated + 4 * L * D_att * ctx
    # no logits in prefill; causal attention over each prompt, at the mean prompt length
    prefill_f = 2 * (N - embed) * prefilled + 2 * L * D_att * a.prompts * prompt_len ** 2
    flops = update_f + decode_f + prefill_f
    peak = a.peak_tflops * 1e12
    weights = N * 2                                # a decode step reads the bf16 weights once
    mean_ctx = ctx / max(generated, 1)
    B = a.slots
    step_bytes = weights + B * mean_ctx * kv_bytes_per_token(cfg)
    if decode_step_s is None:
        decode_step_s = step_bytes / (a.decode_frac * a.hbm_tbs * 1e12)
    decode_s = generated / B * decode_step_s
    predicted = (decode_s + prefill_f / (a.prefill_mfu * peak)
                 + update_f / (a.update_mfu * peak))
    return flops, predicted, decode_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="long",
                    help="long (mean 4K, cap 16K), short (cap 1K), video_qa, long_context_ring, "
                         "or CONFIG[:ARG] of configs/")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=None,
                    help="rl.prompts_per_step (32; video_qa 16, long_context_ring 8)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=None,
                    help="data.max_prompt_len (256; long_context_ring 16384, its prompts "
                         "90-100%% of it)")
    ap.add_argument("--frames", type=int, default=64,
                    help="video.num_frames (video_qa): 2 a temporal patch of up to 256 tokens")
    ap.add_argument("--mean", type=float, default=None, help="mean response length (pre-cap)")
    ap.add_argument("--cap", type=int, default=None, help="rl.max_new_tokens")
    ap.add_argument("--slots", type=int, default=None,
                    help="rollout.max_slots (256; video_qa 128, long_context_ring 64)")
    ap.add_argument("--budget", type=int, default=0, help="rl.max_tokens_per_micro (0: derive)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="rl.logprob_chunk (0: 8192, or 2048 for 7B shapes)")
    ap.add_argument("--pool-fraction", type=float, default=0.4)
    ap.add_argument("--prefill-tokens", type=int, default=16384)
    ap.add_argument("--recompute-old-logp", action="store_true")
    ap.add_argument("--estimator", default="",
                    help="rl.estimator (default: the config's, grpo); gae runs PPO's step with "
                         "a critic")
    ap.add_argument("--peak-tflops", type=float, default=791.0)
    ap.add_argument("--hbm-tbs", type=float, default=4.1)
    ap.add_argument("--decode-frac", type=float, default=0.50,
                    help="the roofline prediction's share of the HBM roofline for decode")
    ap.add_argument("--decode-ms", type=float, default=0.0,
                    help="the rollout bench's ms a decode step of full slots at the run's mean "
                         "context (0: measure it after the run; with --table-from, 0 leaves "
                         "only the roofline prediction)")
    ap.add_argument("--prefill-mfu", type=float, default=0.74)
    ap.add_argument("--update-mfu", type=float, default=0.0,
                    help="the update's MFU in the prediction (0: measure the update bench's "
                         "step, train_step.py's, at the run's row length after the run; with "
                         "--table-from, 0 takes 0.60, that bench's rate at 16K-32K)")
    ap.add_argument("--skip-rates", action="store_true",
                    help="measure neither the decode nor the update rate after the run: no "
                         "composition column but the roofline one (whose update runs at "
                         "--update-mfu, else 60%%)")
    ap.add_argument("--workdir", default="/tmp/lrl-bench-grpo-step")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--partial", action="store_true",
                    help="rollout.partial: stop once prompts_per_step groups are done (or in the "
                         "tail, --partial-tail), carry the rest")
    ap.add_argument("--partial-tokens", type=int, default=-1,
                    help="rollout.partial_tokens with --partial (-1: prompts x group x mean, "
                         "what a step trains on average; 0: no budget)")
    ap.add_argument("--partial-tail", type=float, default=0.5,
                    help="rollout.partial_tail with --partial: stop once nothing waits and fewer "
                         "than this share of the slots are live")
    ap.add_argument("--max-staleness", type=int, default=4, help="rollout.max_staleness")
    ap.add_argument("--no-narrow", action="store_true",
                    help="rollout.narrow_decode=False: every decode call computes all slots")
    ap.add_argument("--param-dtype", default="",
                    help="model.param_dtype (default: the config's; bfloat16 for 7B shapes, "
                         "as the recorded rows ran; float32 there offloads the optimizer)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override after the bench's own, e.g. model.remat=full")
    ap.add_argument("--profile-step", type=int, default=0,
                    help="trace GRPO step K with jax.profiler and print how it used the device "
                         "(busy, time per program, idle gaps between which programs)")
    ap.add_argument("--profile-dir", default="/tmp/lrl-bench-grpo-step-trace")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--table-from", default="",
                    help="print the table of a run's metrics.jsonl (one cut short, say) "
                         "without running; give the run's other flags as they were")
    a = ap.parse_args()
    d = {**GENERIC, **DEFAULTS.get(a.case, {})}
    if a.smoke:   # tiny shapes (case_name: the text smoke runs qwen2_5_math's)
        d.update(SMOKE, prompt=192 if case_name(a) == "long_context_ring" else SMOKE["prompt"])
        for k in ("group", "steps", "prefill_tokens", "chunk", "frames"):
            setattr(a, k, d[k])
    for k in ("mean", "cap", "prompts", "slots", "prompt"):
        if getattr(a, k) is None or a.smoke and k not in ("mean", "cap"):
            setattr(a, k, d[k])
    if a.partial_tokens < 0:
        a.partial_tokens = int(a.prompts * a.group * min(a.mean, a.cap))

    import logging

    from lrl import build, grpo, loop, rewards
    # The build's own sizing lines (the micro-batch budget, the engine's pool) and the loop's
    # on the console.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    for name in ("lrl.loop", "lrl.build"):
        logging.getLogger(name).setLevel(logging.INFO)
    from lrl.rewards import registry

    if "bench_coin" not in registry.names():
        rewards.register("bench_coin")(_coin)
    c = make_config(a)
    if a.table_from:
        a.update_mfu = a.update_mfu or 0.60
        return table(a, c, a.table_from, wall=float("nan"))

    def with_lengths(*args):
        s, live = build.grpo(*args)
        return dataclasses.replace(s, max_new_fn=lengths_fn(a.mean, a.cap, 0)), live

    step = traced(grpo.step, a.profile_step, a.profile_dir) if a.profile_step else grpo.step
    import shutil
    shutil.rmtree(a.workdir, ignore_errors=True)
    t0 = time.time()
    metrics_path = os.path.join(a.workdir, "metrics.jsonl")
    try:
        loop.run(c, a.workdir, build=with_lengths, step=step)
    except BaseException:
        # The steps that ran are measured even when the run stops after them (the 7B run's
        # final checkpoint did): their table before the error, with the roofline column only.
        if os.path.exists(metrics_path) and _step_rows(metrics_path):
            print("\nThe run stopped after the steps below; its error follows.", flush=True)
            a.update_mfu = a.update_mfu or 0.60
            table(a, c, metrics_path, wall=time.time() - t0)
        raise
    wall = time.time() - t0
    if a.skip_rates:   # the roofline column only
        a.update_mfu = a.update_mfu or 0.60
    if not (a.decode_ms or a.skip_rates):
        bench = decode_rate(a, c, _step_rows(metrics_path))
        a.decode_ms = bench["step_ms"]
    if not a.update_mfu:
        a.update_mfu = update_rate(a, c, _step_rows(metrics_path))["mfu"]
    table(a, c, metrics_path, wall=wall)
    if a.profile_step:
        from experiments.bench.profile import timeline
        print(f"\nGRPO step {a.profile_step} as the device ran it:\n" +
              timeline(a.profile_dir), flush=True)


def traced(step_fn, k: int, log_dir: str):
    """`grpo.step` with its k-th call (1-based) traced by jax.profiler into `log_dir`."""
    import shutil

    import jax
    calls = [0]

    def step(*args, **kw):
        calls[0] += 1
        if calls[0] != k:
            return step_fn(*args, **kw)
        shutil.rmtree(log_dir, ignore_errors=True)
        jax.profiler.start_trace(log_dir)
        try:
            out = step_fn(*args, **kw)
            jax.block_until_ready(out[0])
        finally:
            jax.profiler.stop_trace()
        return out
    return step


def _step_rows(metrics_path: str) -> list[dict]:
    rows = [json.loads(x) for x in open(metrics_path)]
    return [r for r in rows if "pack/tokens" in r]


def _model_config(a, c):
    """The text decoder's ModelConfig as the loop builds it (for the video task: the random
    Qwen2.5-VL policy's, `lrl.tasks.video.policy_config`), from the run's saved tokenizer."""
    from lrl import build
    opts = build.options(c)
    if opts.task == "video":
        from lrl.tasks import video, video_data
        return video.policy_config(opts, video_data.build_tokenizer(opts, a.workdir)).text
    from lrl.tasks import text
    return text.model_config(opts, text.build_tokenizer(opts, a.workdir))


def decode_rate(a, c, rows: list[dict]) -> dict:
    """The rollout bench's decode step (`rollout.py`'s `bench_case`, its settings) for
    `a.slots` full slots at the run's mean context over its steps after the first (which
    compiled): prompts of T tokens each growing by n, T + n/2 that context. Run after the
    loop, in its process, with the weights in the decode layout's dtype."""
    import gc

    import jax
    from experiments.bench.profile import sibling
    from lrl.models import init_params
    gc.collect()   # the loop's engine and state
    timed = rows[1:] or rows
    generated = sum(r["rollout/new_tokens"] for r in timed)
    ctx = sum(r["rollout/kv_token_steps"] for r in timed) / max(generated, 1)
    n = 32 if a.smoke else 128
    T = max(8, int(round(ctx - n / 2)))
    ro = sibling("rollout")
    knobs = ro.settings(["--smoke"] * a.smoke + ["--page-size", str(c.rollout.page_size),
                                                 "--hbm-tbs", str(a.hbm_tbs)])
    cfg = _model_config(a, c)
    cfg = dataclasses.replace(cfg, param_dtype=cfg.dtype, remat="none")
    params = init_params(cfg, jax.random.key(0))
    r = ro.bench_case(cfg, params, f"{a.slots}x{T}x{n}", knobs,
                      ro.weight_bytes_per_step(cfg, params))
    print(f"rollout bench at the run's mean context {ctx:.0f}: {r['case']} (mean context "
          f"{T + n / 2:.0f}), {r['step_ms']:.2f} ms a step ({r['roofline_frac']:.0%} of the "
          f"HBM roofline's {r['roofline_ms']:.2f})", flush=True)
    del params
    return r


def update_rate(a, c, rows: list[dict]) -> dict:
    """The update bench's step (`train_step.py`'s `measure`: one packed row, AdamW) at the
    run's row length, for its model as the loop builds it (remat, dtypes, log-prob chunk,
    fused head), after the loop in its process. Its MFU counts FLOPs as `flops_and_prediction`
    does (6 N a token + 6 L D_att T^2, N without the input embedding), so the prediction
    applies the rate the bench reached to the run's own FLOPs."""
    import gc

    import jax
    from experiments.bench.profile import sibling
    from lrl import mesh as mesh_lib
    gc.collect()
    T = int(rows[-1].get("pack/row_len") or c.rl.row_len)
    cfg = _model_config(a, c)
    # the bench's row is text: M-RoPE's sections change which frequencies rotate, not FLOPs
    cfg = dataclasses.replace(cfg, mrope_section=())
    mesh = mesh_lib.make_mesh({"fsdp": -1}, devices=jax.devices()[:1])
    r = sibling("train_step").measure(cfg, mesh, T, repeats=2 if a.smoke else 3,
                                      chunk=c.rl.logprob_chunk, packed=True,
                                      fused_head=c.rl.fused_head)
    D_att = cfg.n_heads * cfg.head_dim
    flops = 6 * matmul_params(cfg) * T + 6 * cfg.n_layers * D_att * T * T
    r["mfu"] = flops / (r["step_s"] * a.peak_tflops * 1e12)
    print(f"update bench at the run's row length: 1 x {T}, {r['step_s']:.3f} s a step, "
          f"{r['mfu']:.1%} MFU ({cfg.remat} remat, compiled in {r['compile_s']:.1f} s)",
          flush=True)
    return r


def table(a, c, metrics_path: str, wall: float):
    """The benchmark's table (and --json) from a run's metrics.jsonl."""
    import jax
    cfg = _model_config(a, c)
    rows = _step_rows(metrics_path)
    n_dev = jax.device_count()
    out = []
    print(f"\n{a.case}: {jax.devices()[0].device_kind} x {n_dev}, jax {jax.__version__}, "
          f"{cfg.num_params() / 1e9:.2f}B params ({c.model.param_dtype} masters), "
          f"{a.prompts} prompts x {a.group}, responses "
          f"log-normal mean {a.mean:.0f} cap {a.cap}, {a.slots} slots, "
          f"{'partial' if a.partial else 'synchronous'} rollout, tail decode "
          f"{'all slots' if a.no_narrow else 'narrowed'}, wall {wall:.0f} s; composition's "
          f"decode at {a.decode_ms or float('nan'):.2f} ms a step of full slots, its update at "
          f"{a.update_mfu:.1%} MFU")
    print("| step | s | rollout s | logprob s | update s | host s | gen tok | trained tok | "
          "resp mean | occupancy | row occ. | decode steps | ms/step | "
          "groups / carried / dropped | pack fill | "
          "micro | compiles | trained tok/s/GPU | MFU | composition | comp. at "
          f"{a.decode_frac:.0%} roofline |")
    print("|" + "---|" * 21)
    bench_step_s = a.decode_ms / 1e3 if a.decode_ms else None
    for r in rows:
        flops, roof_predicted, _ = flops_and_prediction(r, cfg, a)
        flops, predicted, decode_s = (flops_and_prediction(r, cfg, a, bench_step_s)
                                      if bench_step_s else (flops, float("nan"), float("nan")))
        step_s = r["time/step_s"]
        host = step_s - r["time/rollout_s"] - r["time/logprob_s"] - r["time/update_s"]
        rec = dict(step=r["step"], step_s=step_s, rollout_s=r["time/rollout_s"],
                   logprob_s=r["time/logprob_s"], update_s=r["time/update_s"], host_s=host,
                   generated=r["rollout/new_tokens"], trained=r["pack/tokens"],
                   length_mean=r["response/length_mean"],
                   occupancy=r.get("rollout/occupancy", float("nan")),
                   fill=r["pack/fill"], micro=r["pack/micro_batches"],
                   compiles=r["compiles/total"], compiles_step=r["compiles/step"],
                   tok_s_gpu=r["pack/tokens"] / step_s / n_dev,
                   mfu=flops / (step_s * a.peak_tflops * 1e12 * n_dev),
                   composition=predicted / step_s, predicted_s=predicted,
                   composition_roofline=roof_predicted / step_s,
                   bench_decode_ms=a.decode_ms or None,
                   predicted_decode_s=decode_s, decode_steps=r.get("rollout/decode_steps"),
                   decode_s=r.get("rollout/decode_s"), prefill_s=r.get("rollout/prefill_s"),
                   row_occupancy=r.get("rollout/row_occupancy", float("nan")),
                   narrow_calls=r.get("rollout/narrow_calls", 0),
                   carried=r.get("partial/carried_samples", 0),
                   trained_groups=r.get("partial/trained_groups", a.prompts),
                   dropped=r.get("partial/dropped_stale_samples", 0))
        steps_n = rec["decode_steps"] or 0
        rec["ms_per_decode_step"] = 1e3 * (rec["decode_s"] or 0) / max(1, steps_n)
        out.append(rec)
        print(f"| {rec['step']} | {step_s:.1f} | {rec['rollout_s']:.1f} | "
              f"{rec['logprob_s']:.1f} | {rec['update_s']:.1f} | {host:.1f} | "
              f"{rec['generated']:.0f} | {rec['trained']:.0f} | {rec['length_mean']:.0f} | "
              f"{rec['occupancy']:.0%} | {rec['row_occupancy']:.0%} | {steps_n:.0f} | "
              f"{rec['ms_per_decode_step']:.2f} | {rec['trained_groups']:.0f} / "
              f"{rec['carried']:.0f} / {rec['dropped']:.0f} | "
              f"{rec['fill']:.0%} | {rec['micro']:.0f} | "
              f"{rec['compiles']:.0f} (+{rec['compiles_step']:.0f}) | {rec['tok_s_gpu']:.0f} | "
              f"{rec['mfu']:.1%} | {rec['composition']:.2f} | "
              f"{rec['composition_roofline']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(case=a.case, args=vars(a), rows=out, wall_s=wall), f, indent=1)


def _coin(completion: str, answer: str, **meta) -> float:
    return float(random.random() < 0.5)


if __name__ == "__main__":
    main()
