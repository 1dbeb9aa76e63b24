"""The embedded default: a tiny model learns multi-step arithmetic on a laptop CPU.

Nothing is downloaded: the tokenizer is trained locally on the synthetic task's text, the model
is initialised at random, an SFT warm start teaches the `<think>...</think> \\boxed{}` format
and the sums, then GRPO samples G answers per prompt and updates on their verified rewards.
The SFT demonstrations are deliberately imperfect: in 30% of them (`sft.answer_noise`) the
reasoning is right but the boxed answer is off by 1 to 3, as real SFT data has flaws. The warm
start learns that habit too; GRPO, rewarded only for a correct box, unlearns it, which is the
rise its reward curve shows. About ten minutes on a laptop CPU (measured on 2 cores: SFT
4 min, then 80 GRPO steps of about 3 s). The key-value retrieval task
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

PPO with a learned critic (GAE) instead of GRPO's group baseline, on the same task and
budget (docs/ppo.md has its measured reward against this default's):

    python -m lrl.main --config=configs/default.py:ppo --workdir=/tmp/lrl-ppo

Any field can be overridden, e.g. `--config.rl.group_size=8`; unknown keys fail with their name;
`--print_config` lists every field with its comment.
"""
import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "grpo"                  # "grpo" (optionally after an SFT warm start) or "sft"
    c.task = "text"                 # "text" prompts, or "video" (configs/video_synthetic.py)
    c.seed = 0
    c.compile_cache = "auto"         # compiled programs (and the update's memory-derived budget)
                                     # kept for the next start: "auto" = .lrl-cache beside the
                                     # workdir, or a folder; "" = off (lrl/compile_cache.py)

    # --- the policy model -------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""            # a local HF checkpoint directory; empty: init from the fields below
    c.model.model_type = "qwen2"    # architecture when initialising from scratch
    c.model.d_model = 128
    c.model.n_layers = 4
    c.model.n_heads = 4
    c.model.n_kv_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 384
    c.model.vocab_size = 0           # 0: the tokenizer's; more pads the vocabulary (as Qwen's)
    c.model.rope_theta = 10000.0
    c.model.tie_embeddings = True
    c.model.param_dtype = "float32"  # master weights
    c.model.dtype = "float32"        # compute dtype ("bfloat16" on accelerators)
    c.model.attention = "dense"      # dense | ring | ulysses (ring/ulysses shard over mesh.seq)
    c.model.attention_impl = ""      # "" = cuDNN on GPU, XLA elsewhere; or "xla" / "cudnn"
    c.model.remat = "full"           # none | full | dots | dots_no_batch | dots_attn | save_attn | offload_attn
    c.model.param_shard_axes = "fsdp"  # "fsdp,seq": the seq devices shard the parameters too

    # --- tokenizer: a local HF tokenizer dir, or "" to train one on the synthetic task ------
    c.tokenizer = ml_collections.ConfigDict()
    c.tokenizer.path = ""
    c.tokenizer.vocab_size = 300

    # --- the device mesh: sizes per axis, -1 = all remaining devices ------------------------
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, seq=1, tensor=1))
    # --- multi-process runs (one process per host or per GPU); see experiments/launch/ ----
    c.distributed = ml_collections.ConfigDict(dict(
        enabled=False,               # start jax.distributed
        coordinator_address="",      # "host:port" of process 0; "" = detect (SLURM, MPI, TPU)
        num_processes=-1,            # -1 = detect
        process_id=-1,               # -1 = detect
        local_device_ids="",         # "0,1,2,3": the GPUs this process drives; "" = JAX's choice
        initialization_timeout_s=300,
        heartbeat_timeout_s=100,     # a silent peer is declared dead after this; the rest stop
        shutdown_timeout_s=300,
        cpu_collectives="gloo",      # gloo | mpi | none (cross-process collectives on CPU)
        watchdog_s=0.0))             # > 0: exit when no step finishes for this long

    # --- prompts ----------------------------------------------------------------------------
    c.data = ml_collections.ConfigDict()
    c.data.source = "synthetic"      # synthetic | jsonl | parquet
    c.data.paths = ""                # comma-separated files or globs for jsonl/parquet
    c.data.prompt_field = "prompt"
    c.data.answer_field = "answer"
    c.data.messages_field = ""       # a list of chat messages instead of a prompt string
    c.data.system_prompt = ""
    c.data.task = "arithmetic"       # synthetic task: kv_retrieval | arithmetic
    c.data.task_kwargs = ml_collections.ConfigDict(dict(  # per task; the chosen task's are used
        arithmetic=dict(num_terms=3, min_terms=2, max_operand=9),
        kv_retrieval=dict(num_pairs=4, min_pairs=2, key_len=2, value_len=2),
        tool_lookup=dict(num_pairs=13, key_len=1, value_len=1)))
    c.data.size = 100_000            # synthetic examples
    c.data.eval_size = 64            # held-out synthetic examples (other seed)
    c.data.eval_paths = ""           # held-out jsonl/parquet for real data
    c.data.max_prompt_len = 160      # longer prompts are dropped and counted

    # --- SFT (the warm start of a GRPO job, or the whole of an "sft" job) --------------------
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 300                # 0 = no warm start
    c.sft.rows = 8                   # packed rows per step
    c.sft.row_len = 512
    c.sft.answer_noise = 0.3         # synthetic SFT demos that reason right but box a wrong answer
    c.sft.lr = 3e-3
    c.sft.warmup_steps = 20
    c.sft.paths = ""                 # prompt/response records for an "sft" job on real data
    c.sft.response_field = "response"

    # --- GRPO -------------------------------------------------------------------------------
    c.rl = ml_collections.ConfigDict()
    c.rl.steps = 80
    c.rl.prompts_per_step = 16       # P
    c.rl.group_size = 16             # G: a larger group sees more of a prompt's answers
    c.rl.max_new_tokens = 40
    c.rl.temperature = 1.0
    c.rl.top_k = 0
    c.rl.top_p = 1.0
    c.rl.estimator = "grpo"          # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_token |
                                     # remax (also samples one greedy baseline per prompt) | a
                                     # registered name or "pkg.module:fn" (docs/extending.md) |
                                     # gae (PPO: a critic, the `critic` section; docs/ppo.md)
    c.rl.epochs = 1                  # passes over each rollout batch
    c.rl.minibatches = 2             # optimizer steps per epoch (the step's samples split evenly)
    c.rl.row_len = 512               # packed row length for the update; 0 = the token budget
    c.rl.max_tokens_per_micro = 4096  # tokens a data shard takes per micro-batch (rows of
                                     # row_len); 0 = the most device memory holds, derived at
                                     # start-up from the compiled update (one row on a CPU)
    c.rl.logprob_chunk = 1024        # positions of every row per step of the log-prob scan
    c.rl.fused_head = True           # loss gradient formed in the lm head's forward (no logit
                                     # recompute; token-level ratios only, GSPO goes unfused)
    c.rl.recompute_old_logp = False  # True: old log-probs from a trainer forward, not the sampler
    c.rl.dynamic_sampling = False    # DAPO: drop groups whose rewards are all equal, draw more
    c.rl.max_resample = 2            # extra prompt batches dynamic sampling may draw per step
                                     # (partial rollouts: extra decode rounds, each may admit one)
    c.rl.overlong = "none"           # none | mask | penalty (DAPO overlong handling)
    c.rl.overlong_buffer = 8         # penalty ramps over the last N tokens of the limit
    c.rl.overlong_penalty = 1.0
    c.rl.mismatch_fraction = 1.0     # share of a step's micro-batches whose trainer forward is
                                     # compared with the sampler's log-probs (mismatch/ metrics):
                                     # the update's own forward on its first minibatch (the one
                                     # under the weights that sampled), or the old log-probs'
                                     # pass (all micro-batches) when it runs; free either way;
                                     # 0 = no mismatch metrics
    c.rl.shared_prompt = "off"       # off | on | auto: a group's prompt held once per update row
                                     # and computed once, not G times (lrl.data.shared_prompt);
                                     # auto: for groups whose prompt is longer than their mean
                                     # response. Exact: the same loss and gradients
    c.rl.gamma = 1.0                 # gae: discount of the token rewards (verl's algorithm.gamma)
    c.rl.lam = 1.0                   # gae: GAE's lambda (verl's algorithm.lam)
    c.rl.kl_in_reward = False        # subtract beta * KL(old || ref) from each token's reward
                                     # (any estimator; outcome ones see R - beta * sum KL)
    c.rl.kl_ctrl = ml_collections.ConfigDict(dict(
        type="fixed",                # fixed | adaptive (verl's AdaptiveKLController)
        coef=0.001,                  # beta; the adaptive controller's start
        target_kl=0.1,               # adaptive: the KL per sequence it steers to
        horizon=10000,               # adaptive: samples over which beta moves by its error
        estimator="k1"))             # k1 | k2 | k3 | low_var_kl (verl's kl_penalty)
    c.rl.loss = ml_collections.ConfigDict(dict(
        clip_low=0.2,                # PPO clip: the ratio's lower bound is 1 - clip_low
        clip_high=0.28,              # ... and its upper 1 + clip_high (DAPO's clip-higher)
        dual_clip=0.0,               # 0.0 = off; else > 1: caps -A·ratio at -c·A where A < 0
        ratio_level="token",         # token | sequence (GSPO)
        aggregation="seq_mean_token_mean",  # token_mean | seq_mean_token_mean |
                                            # seq_mean_token_sum_norm
        kl_coef=0.0,                 # KL to the frozen reference (0.0: no reference is kept)
        kl_estimator="k3",           # k1 | k2 | k3
        entropy_coef=0.0,            # entropy bonus
        # Rollout correction (lrl/rl/correction.py): the ratio old / sampler of the trainer's
        # and the sampler's log-probs; turning either on takes the old log-probs from a
        # trainer forward (rl.old_logp "trainer").
        tis_cap=0.0,                 # truncated IS: the policy term weighs min(ratio, cap);
                                     # 0.0 = off
        tis_level="token",           # token | sequence (product of the ratios) | geometric
                                     # (their geometric mean): the ratio tis_cap caps
        mask_level="none",           # none | token | sequence | geometric: drop a token, or a
                                     # whole sequence, whose ratio at that level leaves
                                     # [mask_low, mask_high] (masked IS; denominators kept)
        mask_low=0.5,                # lower end of the band (<= 1)
        mask_high=2.0,               # upper end of the band (>= 1)
        staleness_decay=1.0,         # a sample's policy term weighs decay ** age (age: policy
                                     # versions behind the trainer; 0 today); 1.0 = off
        max_staleness=-1,            # samples older than this weigh 0; -1 = no bound
        policy_loss="ppo_clip"))     # the per-token policy term: ppo_clip (PPO clip with the
                                     # options above) | a registered name or "pkg.module:fn"
                                     # (docs/extending.md); aggregation, KL, entropy and the
                                     # rollout correction apply to it alike

    # --- optimizer (GRPO phase) ---------------------------------------------------------------
    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-4, warmup_steps=5, weight_decay=0.0, b1=0.9, b2=0.99, clip_norm=1.0))

    # --- the critic (rl.estimator="gae": PPO; lrl/rl/critic.py, docs/ppo.md) -------------------
    c.critic = ml_collections.ConfigDict(dict(
        hf_path="",                  # "": the policy's weights as this phase starts; else a HF
                                     # *ForTokenClassification (1 label) or
                                     # *ForSequenceClassification checkpoint (its score head)
        head_init_std=0.0,           # the value head starts at zero (0.0) or N(0, std^2)
        remat="",                    # "": the policy's remat policy; else one of model.remat's
        warmup_steps=0,              # first steps update the critic alone (verl's critic_warmup)
        ppo_epochs=1,                # critic passes over each step's minibatches
        cliprange_value=0.5,         # value clip around the old values (verl's 0.5)
        optim=dict(lr=1e-5, warmup_steps=0, weight_decay=0.0, b1=0.9, b2=0.999,
                   clip_norm=1.0)))

    # --- rewards: [(registry name, weight), ...] scored in a worker pool ---------------------
    c.reward = ml_collections.ConfigDict()
    c.reward.spec = "synthetic:1.0"  # "name:weight,name:weight"
    c.reward.num_workers = 2
    c.reward.timeout_s = 10.0
    c.reward.fail_frac = 1.0         # share of a scoring call's items failing that fails the call
    c.reward.fail_patience = 3       # that many failed calls in a row stop the run; 0: never
    # A reward model, the spec's "rm" term (e.g. spec="math:0.8,rm:0.2"), scored on the mesh in
    # its own chat template (docs/reward-models.md).
    c.reward.model = ml_collections.ConfigDict(dict(
        hf_path="",                  # a *ForSequenceClassification directory; "" = none
        tokenizer_path="",           # "" = the reward model's directory
        max_len=4096,                # tokens of its packed rows; longer conversations are cut
        batch_rows=8,                # rows of one forward call (a multiple of data x fsdp)
        dtype="bfloat16"))

    # --- rollout engine ---------------------------------------------------------------------
    # Built once for the run: its pool, compiled programs and decode-layout weights are kept.
    c.rollout = ml_collections.ConfigDict(dict(
        page_size=16, max_slots=128,
        pool_tokens=0,               # 0: pool_fraction of the device memory the train state
        pool_fraction=0.4,           # leaves (capped at every slot's longest sample; a CPU,
                                     # which reports no memory, gets exactly that)
        prefill_tokens=2048,         # tokens of one prefill call: prompts share its rows
        sp_min_tokens=0,             # with ring/ulysses over seq > 1: prompts of at least this
                                     # many tokens are prefilled sequence-parallel
        narrow_decode=True,          # the tail's decode calls compute only the live slots' rows
                                     # (programs for a quarter, a sixteenth, ... of the slots)
        overlap_admission=True,      # while samples wait, launch the next decode call before
                                     # collecting the last, so the host's bookkeeping runs
                                     # while the device decodes (a freed slot is refilled a
                                     # call later); False: collect each call, then refill
        # Partial rollouts: a step's rollout stops once rl.prompts_per_step groups have
        # finished (or partial_tokens are spent) instead of waiting for the longest sample;
        # the unfinished samples carry on in the next step under the new weights, each token
        # keeping the log-prob and version of the policy that drew it (text task only).
        partial=False,
        partial_tokens=0,            # decode tokens one step's rollout samples at most (checked
                                     # after each decode call is collected, with the next one,
                                     # overlap_admission's, in flight); 0 = stop on finished
                                     # groups only
        partial_tail=-1.0,           # also stop once no sample waits and fewer than this share
                                     # of the slots are live (the tail); 0 = never; -1 = 0.5
                                     # with partial (measured: docs/partial-rollouts.md)
        partial_seconds=0.0,         # also stop once the rollout has run this long (checked
                                     # after each decode call); 0 = no time budget
        partial_backlog=0.0,         # > 0: new prompts are drawn until the unfinished samples
                                     # fill the slots (at most a step's samples) and this many
                                     # steps' samples wait behind them, to refill the slots the
                                     # step's finishing samples free (fuller slots, older
                                     # groups: more dropped at max_staleness); 0 = a batch while
                                     # the slots are not full (they drain before the step stops)
        max_staleness=2,             # a carried group whose oldest token is more than this many
                                     # steps old is dropped (and counted), never trained
        partial_keep_kv=True,        # with partial: a carried sample's KV pages stay in the
                                     # engine's pool and it resumes without a prefill (its
                                     # KV then is the old policy's; False: prefilled again
                                     # under the new weights); pages short: prefilled anyway
        # Multi-turn rollouts with tools (lrl.trajectories, docs/tools-task.md)
        env="",                      # "" = one response per sample; "tool": the model calls
                                     # the registered tools (lrl.envs) over several turns
        max_turns=4,                 # model turns a trajectory has at most
        max_turn_tokens=0,           # tokens one model turn samples at most; 0 = no cap (the
                                     # trajectory's cap, rl.max_new_tokens, still holds)
        tool_timeout_s=10.0,         # an environment step longer than this ends the trajectory
        turn_reward="sum",           # sum | discount: the trajectory's reward = final + per-turn
        turn_discount=1.0))          # rewards, each turn's weighed turn_discount ** turn with
                                     # "discount"

    # --- one-step-off pipeline (lrl.pipeline): the rollout samples step t+1 on its own devices
    # while the others update on step t; each step then trains on samples one policy version
    # old (its first step samples synchronously). Off on one device: it has nothing to split.
    c.pipeline = ml_collections.ConfigDict(dict(
        rollout_devices=0,           # 0 = off; n = the last n devices sample, the rest train
                                     # (shaped by mesh.*, whose -1 counts only those)
        rollout_tensor=0))           # the rollout mesh's tensor size; 0 = all n devices

    # --- evaluation, checkpoints, metrics -------------------------------------------------------
    c.eval = ml_collections.ConfigDict(dict(every=10, num_prompts=64, k=4, temperature=1.0))
    c.checkpoint = ml_collections.ConfigDict(dict(every_steps=20, every_minutes=0.0, keep=2))
    c.metrics = ml_collections.ConfigDict(dict(
        tensorboard=True, samples_per_step=2,
        wandb_project="",            # a Weights & Biases project: steps, config and output
                                     # files logged there too (pip install wandb); "" = off
        wandb_entity="",             # "" = your default entity
        wandb_name="",               # the W&B run's name; "" = the workdir's name
        wandb_mode="online"))        # online | offline (under <workdir>/wandb, `wandb sync`)

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
        c.rl.update(estimator="gae", gamma=1.0, lam=1.0)
        # The critic starts as the SFT'd policy with a zero head: a few steps of it alone
        # first, at a larger rate than the actor's (verl's examples: 10x), two passes a step.
        c.critic.update(warmup_steps=2, ppo_epochs=2, cliprange_value=0.5)
        c.critic.optim.update(lr=1e-3, warmup_steps=0)
    elif arg in ("tools", "tools_runlocal"):
        # Multi-turn with a tool (docs/tools-task.md): the prompt names a key of a table it
        # does not show; the model calls lookup, reads the tool's response and boxes the
        # value. 30% of the SFT demos skip the tool and box a guess; GRPO learns that the
        # tool is needed (measured, docs/tools-task.md: tool calls 70% -> 87% of the
        # trajectories in 30 steps, held-out reward 0.34 -> 0.375; 14 min on 2 loaded cores).
        # One-letter keys and one-digit values: the copies a model this small learns in
        # minutes.
        c.data.task = "tool_lookup"
        c.tokenizer.vocab_size = 320   # the 4 tool-call tokens on top of the default's merges
        c.reward.spec = "synthetic:1.0"   # the boxed value of the trajectory's last turn
        c.sft.update(steps=600, rows=8, row_len=256)   # 300 left the value uncopied
        c.rl.update(steps=30, prompts_per_step=8, group_size=8, max_new_tokens=64, row_len=256)
        c.rollout.update(env="tools", max_turns=3, max_turn_tokens=24, max_slots=64)
        c.eval.update(every=10, num_prompts=32)
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
