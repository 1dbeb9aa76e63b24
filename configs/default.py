"""The embedded default: a tiny model learns multi-step arithmetic on a laptop CPU.

Nothing is downloaded: the tokenizer is trained locally on the synthetic task's text, the model
is initialised at random, an SFT warm start teaches the `<think>...</think> \\boxed{}` format
and the sums, then GRPO samples G answers per prompt and updates on their verified rewards.
The SFT demonstrations are deliberately imperfect: in 30% of them (`sft.answer_noise`) the
reasoning is right but the boxed answer is off by 1 to 3, as real SFT data has flaws. The warm
start learns that habit too; GRPO, rewarded only for a correct box, unlearns it, which is the
rise its reward curve shows. About ten to fifteen minutes on a laptop CPU (measured on 2 cores: SFT
4 min, then 80 GRPO steps of about 3 s; on 2026-12-06, 14:05: SFT 6:31, GRPO 7:24). The key-value retrieval task
(`--config.data.task=kv_retrieval --config.tokenizer.vocab_size=320`) needs more SFT than ten
minutes give a model this small: measured here, 400 SFT steps did not teach it to copy.

    python -m lrl.main --config=configs/default.py --workdir=/tmp/lrl-default

Small variant for tests and smoke runs: every part runs (tokenizer, SFT, rollouts, rewards,
GRPO updates, held-out evals, checkpoints, plots), on an easier task so that some samples are
right, in about a minute on 2 CPU cores (measured 2026-12-01: 1:19 and 1:35 of wall time with
the two cores shared with other jobs at a load of 6-8, 47 s of CPU time; training rewards
0.375, 0.06, 0.19 and a held-out reward of 0.14, pass@4 0.45, after SFT). Its 3 GRPO steps
teach nothing: the point is that everything runs (a step whose 16 samples are all wrong has
no gradient, and its console line says so).

    python -m lrl.main --config=configs/default.py:runlocal --workdir=/tmp/lrl-smoke

PPO with a learned critic (GAE) instead of GRPO's group baseline, on the same task, 32
prompts x 4 samples a step (docs/ppo.md has its measured reward against this default's in
the same wall time):

    python -m lrl.main --config=configs/default.py:ppo --workdir=/tmp/lrl-ppo

Multi-turn GRPO with a tool: the model looks up a key of a table its prompt does not show,
reads the tool's response and boxes the value (docs/tools-task.md; about 12 minutes on CPU):

    python -m lrl.main --config=configs/default.py:tools --workdir=/tmp/lrl-tools

Any field can be overridden, e.g. `--config.rl.group_size=8`; unknown keys fail with their name;
`--print_config` lists every field with its doc.
"""
import ml_collections

from lrl import schema


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    # Every field's default, type, bound and doc is declared once, in lrl/schema.py; this file
    # is those defaults and the variants below.
    c = schema.config_dict()

    if arg == "runlocal":  # about a minute on 2 CPU cores: every part runs, nothing is learnt
        # One + or - of numbers 0..4 a prompt: 40 SFT steps of the default's task left every
        # GRPO sample wrong (reward 0, no gradient); 100 short steps of this one (rows of 256
        # tokens, a step 8x cheaper than the default's) get some samples right.
        c.data.task_kwargs.arithmetic.update(num_terms=2, min_terms=2, max_operand=4)
        c.sft.update(steps=100, rows=4, row_len=256, answer_noise=0.0, warmup_steps=10)
        c.rl.update(steps=3, prompts_per_step=4, group_size=4, max_new_tokens=24)
        c.optim.warmup_steps = 1
        c.eval.update(every=3, num_prompts=8)
        c.reward.num_workers = 0
    elif arg == "ppo":  # PPO: a critic and GAE instead of GRPO's group baseline (docs/ppo.md)
        # A critic's forward and update cost about what the actor's update does (measured: a
        # step of 16 x 16 samples took 2.2x GRPO's), so PPO samples half as many a step:
        # 32 prompts x 4, as it needs no group baseline, and its step costs about GRPO's.
        c.rl.update(estimator="gae", gamma=1.0, lam=1.0, prompts_per_step=32, group_size=4)
        # The critic starts as the SFT'd policy with a zero head (advantages: the whitened
        # rewards until it learns), at 10x the actor's rate (verl's examples), one pass a
        # step, no remat (memory is no concern on a CPU; a third less compute).
        c.critic.update(warmup_steps=0, ppo_epochs=1, cliprange_value=0.5, remat="none")
        c.critic.optim.update(lr=1e-3, warmup_steps=0)
    elif arg in ("tools", "tools_runlocal"):
        # Multi-turn with a tool (docs/tools-task.md): the prompt names a key of a table it
        # does not show; the model calls lookup, reads the tool's response and boxes the
        # value. 30% of the SFT demos skip the tool and box a guess; GRPO learns that the
        # tool is needed (measured, docs/tools-task.md: tool calls 67% -> 85% of the
        # trajectories in 30 steps, held-out reward 0.707 -> 0.793; 12 min on 2 loaded cores).
        # One-letter keys and one-digit values: the copies a model this small learns in
        # minutes.
        c.data.task = "tool_lookup"
        c.tokenizer.vocab_size = 320   # the 4 tool-call tokens on top of the default's merges
        c.reward.spec = "synthetic:1.0"   # the boxed value of the trajectory's last turn
        c.sft.update(steps=900, rows=8, row_len=256)   # 600 (masked loss) copied 1 in 4
        c.rl.update(steps=30, prompts_per_step=8, group_size=8, max_new_tokens=64, row_len=256)
        c.rollout.update(env="tools", max_turns=3, max_turn_tokens=24, max_slots=64)
        c.eval.update(every=10, num_prompts=64)   # 256 samples: about +-0.03
        if arg == "tools_runlocal":   # every part once, in about a minute
            c.sft.update(steps=20, rows=4, warmup_steps=2)
            c.rl.update(steps=2, prompts_per_step=4, group_size=4)
            c.optim.warmup_steps = 1
            c.eval.update(every=2, num_prompts=4)
            c.data.eval_size = 4
            c.reward.num_workers = 0
    elif arg:
        raise ValueError(f"configs/default.py: unknown argument {arg!r}; use 'runlocal', "
                         "'ppo', 'tools', 'tools_runlocal' or none")
    return c
