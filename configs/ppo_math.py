"""PPO with a learned critic on math with Qwen2.5-1.5B: actor and critic both from the same
local HF checkpoint (the critic: its decoder with a value head at zero, or `critic.hf_path`, a
*ForTokenClassification / *ForSequenceClassification checkpoint), on one mesh, with verl's
PPO example settings (examples/ppo_trainer: gamma 1.0, lam 1.0, value clip 0.5, critic lr
1e-5, actor lr 1e-6, a critic warm-up). Data and reward as configs/qwen2_5_math.py.

    python -m lrl.main --config=configs/ppo_math.py --workdir=/runs/q15-ppo \\
        --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct \\
        --config.tokenizer.path=/models/Qwen2.5-1.5B-Instruct \\
        --config.data.paths=/data/math/train.jsonl --config.data.eval_paths=/data/math/test.jsonl

`:lam95` uses lam 0.95 (a shorter-horizon, lower-variance advantage; verl's other setting).
docs/ppo.md says what is verl's and what differs.
"""
from lrl import config_util


def get_config(arg: str | None = None):
    if arg not in (None, "", "lam95"):
        raise ValueError(f"configs/ppo_math.py: argument {arg!r}; use 'lam95' or none")
    c = config_util.load_sibling(__file__, "qwen2_5_math.py", "1.5b")
    c.rl.update(estimator="gae", gamma=1.0, lam=0.95 if arg == "lam95" else 1.0,
                # The critic is the baseline: groups of equal rewards still teach it, and the
                # samples need not come in large groups (verl's PPO example: n=1; 4 here keeps
                # the rollout's prompt sharing).
                group_size=4, prompts_per_step=128, dynamic_sampling=False,
                kl_in_reward=False)
    c.rl.kl_ctrl.update(type="fixed", coef=0.001, estimator="k1")
    c.rl.loss.update(clip_low=0.2, clip_high=0.2, aggregation="token_mean", kl_coef=0.0)
    c.optim.update(lr=1e-6, warmup_steps=0)
    c.critic.update(hf_path="",                # the policy's own checkpoint, head at zero
                    head_init_std=0.0, remat="",
                    warmup_steps=5,            # verl's trainer.critic_warmup: critic alone first
                    ppo_epochs=1, cliprange_value=0.5)
    c.critic.optim.update(lr=1e-5, warmup_steps=0, weight_decay=0.01, b1=0.9, b2=0.999,
                          clip_norm=1.0)
    return c
