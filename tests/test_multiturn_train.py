"""Multi-turn training (issue 40, the training side): the tool task's tokens and template, the
trajectory's tokens reaching the update exactly as sampled and inserted, the loss mask
covering the model's tokens alone (observation tokens get no gradient and never enter the
rollout correction or the mismatch metrics), the trajectory reward, and the tools config."""
import dataclasses
import os

import jax
import numpy as np
import pytest

from lrl import collect, config_util, grpo, models, options, step_setup, trajectories
from lrl.data import synthetic
from lrl.data import tokenizer as tok_lib
from lrl.groups import Groups
from lrl.tasks import Prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = models.ModelConfig(model_type="qwen2", vocab_size=64, d_model=32, n_layers=2,
                          n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, remat="none")
KW = dict(num_pairs=64, key_len=2, value_len=3)


@pytest.fixture(scope="module")
def tool_tok():
    corpus = synthetic.synthetic_corpus(300, 0, tasks=("tool_lookup",),
                                        task_kwargs={"tool_lookup": KW})
    return tok_lib.build_tokenizer(corpus, 320, tools=True)


# ----------------------------------------------------------------------------- the task

def test_tool_task_keeps_the_table_out_of_the_prompt_and_demonstrates_the_call():
    ex = synthetic.sft_example("tool_lookup", 0, 3, **KW)
    key, table = ex["metadata"]["key"], ex["metadata"]["table"]
    assert len(table) == 64 and table[key] == ex["answer"]
    assert key in ex["prompt"] and ex["answer"] not in ex["prompt"]
    assert not any(v in ex["prompt"] for v in table.values())
    call, obs, final = ex["turns"]
    assert call["content"] == ('<tool_call>{"name": "lookup", "arguments": {"key": "%s"}}'
                               '</tool_call>' % key)
    assert obs == {"role": "tool", "content": ex["answer"]}
    assert final["content"] == f"\\boxed{{{ex['answer']}}}"   # the tool's answer, boxed
    # Noisy demonstrations skip the tool and box a wrong guess (one turn).
    noisy = [synthetic.sft_example("tool_lookup", 0, i, answer_noise=0.5, **KW)
             for i in range(40)]
    skipped = [e for e in noisy if len(e["turns"]) == 1]
    assert 5 < len(skipped) < 35
    assert all("<tool_call>" not in e["response"] and f"{{{e['answer']}}}" not in e["response"]
               for e in skipped)


def test_tool_markup_is_one_token_each_and_the_default_tokenizer_is_unchanged(tool_tok):
    ids = tool_tok.convert_tokens_to_ids(list(tok_lib.TOOL_TOKENS) + ["<think>", "</think>"])
    assert ids == list(range(314, 320)) and len(tool_tok) == 320
    assert tool_tok.chat_template == tok_lib.TOOL_TEMPLATE
    text = '<tool_call>{"name": "lookup"}</tool_call>'
    pieces = tool_tok.convert_ids_to_tokens(tool_tok(text, add_special_tokens=False)["input_ids"])
    assert pieces[0] == "<tool_call>" and pieces[-1] == "</tool_call>"
    corpus = synthetic.synthetic_corpus(300, 0, tasks=("arithmetic",))
    plain = tok_lib.build_tokenizer(corpus, 300)
    assert plain.chat_template == tok_lib.CHAT_TEMPLATE and len(plain) == 300
    assert plain.convert_tokens_to_ids(["<think>", "</think>"]) == [298, 299]
    assert len(plain("<tool_call>", add_special_tokens=False)["input_ids"]) > 1


def test_sft_demo_is_the_template_render_and_the_template_drops_earlier_thinking(tool_tok):
    ex = synthetic.sft_example("tool_lookup", 0, 7, **KW)
    prompt = tool_tok.apply_chat_template(ex["messages"], tokenize=False,
                                          add_generation_prompt=True)
    whole = tool_tok.apply_chat_template(ex["messages"] + ex["turns"], tokenize=False)
    assert prompt + ex["response"] + "<|im_end|>\n" == whole
    # A conversation whose first turn thinks: rendered again after the tool's answer, the
    # template drops that <think> block, so the history's tokens change. The trajectory the
    # update trains must be the tokens as sampled, never this re-rendering.
    turns = [{"role": "assistant", "content": "<think>need the tool</think>\n"
              + ex["turns"][0]["content"]}] + ex["turns"][1:]
    sampled = prompt + turns[0]["content"]
    again = tool_tok.apply_chat_template(ex["messages"] + turns, tokenize=False)
    assert "need the tool" not in again and not again.startswith(sampled)


def test_sft_trains_the_model_turns_and_masks_the_observation(tool_tok):
    """A tool demonstration's loss covers what the model writes (its turns, each with its
    <|im_end|>, and the final EOS); what the rollout appends (`lrl.envs.observation_ids` of
    the tool's message: the tool's value among it) is read, never a target."""
    from lrl.data import prompts
    from lrl.envs import observation_ids
    ex = synthetic.sft_example("tool_lookup", 0, 7, **KW)
    p, r = prompts.tokenize_sft(tool_tok, ex)
    mask = prompts.response_train_mask(tool_tok, ex, r)
    end = tool_tok.convert_tokens_to_ids("<|im_end|>")
    obs = observation_ids(tool_tok, [ex["turns"][1]], last_token=end, end_ids=(end,))
    call = tool_tok(ex["turns"][0]["content"], add_special_tokens=False)["input_ids"] + [end]
    final = tool_tok(ex["turns"][2]["content"], add_special_tokens=False)["input_ids"]
    assert list(r) == call + obs + final + [tool_tok.eos_token_id]
    assert list(mask) == [1.0] * len(call) + [0.0] * len(obs) + [1.0] * (len(final) + 1)
    assert synthetic.render_turns(ex["turns"]) == ex["response"]
    skip = next(e for i in range(40) if len((e := synthetic.sft_example(
        "tool_lookup", 0, i, answer_noise=0.5, **KW))["turns"]) == 1)
    assert prompts.response_train_mask(tool_tok, skip, prompts.tokenize_sft(tool_tok, skip)[1]
                                       ).all()
    bad = {**ex, "response_segments": [("<tool_ca", True), ("ll>", True)]}
    with pytest.raises(ValueError, match="response_segments"):
        prompts.response_train_mask(tool_tok, bad, r)


def test_sft_loss_ignores_the_observation_targets():
    """Changing the targets at the masked (observation) positions leaves the SFT loss and
    its update unchanged; without the masks the same change moves the loss."""
    import optax
    from lrl.data import packing
    from lrl.rl import update as upd
    from lrl.rl.sft import make_sft_fn
    rng = np.random.RandomState(0)
    prompts_ = [rng.randint(2, 64, 5) for _ in range(3)]
    responses = [rng.randint(2, 64, n) for n in (9, 7, 11)]
    masks = [np.array([1, 1, 0, 0, 0, 1, 1, 1, 1.0]), None,
             np.array([1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1.0])]
    params = models.init_params(TINY, jax.random.key(2))
    fn = make_sft_fn(TINY, optax.sgd(1.0))

    full, _ = packing.sft_pack(prompts_, responses, 32, min_rows=2)
    masked, _ = packing.sft_pack(prompts_, responses, 32, min_rows=2, train_masks=masks)
    off = (full["loss_mask"] > 0) & (masked["loss_mask"] == 0)   # the observation targets
    assert full["loss_mask"].sum() == 27 and off.sum() == 8
    np.testing.assert_array_equal(masked["tokens"], full["tokens"])

    def run(batch, scramble):
        batch = dict(batch)
        if scramble:
            batch["targets"] = np.where(off, (batch["targets"] + 7) % 64, batch["targets"])
        state = upd.init_train_state(jax.tree.map(jax.numpy.array, params), optax.sgd(1.0))
        new, m = fn(state, batch)
        return float(m["loss"]), jax.tree.map(np.asarray, new.params)

    (l0, p0), (l1, p1) = run(masked, False), run(masked, True)
    assert l0 == pytest.approx(l1, rel=1e-6)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # Unmasked, the same positions are targets: the same change moves the loss.
    assert run(full, False)[0] != pytest.approx(run(full, True)[0], rel=1e-3)


def test_trajectory_text_marks_the_observations(tool_tok):
    """samples.jsonl's trajectory: the model's turns as sampled, the environment's tokens
    wrapped in [observation] marks."""
    from lrl.data import prompts
    ex = synthetic.sft_example("tool_lookup", 0, 7, **KW)
    _, r = prompts.tokenize_sft(tool_tok, ex)
    mask = prompts.response_train_mask(tool_tok, ex, r)
    text = trajectories.trajectory_text(tool_tok, r, mask)
    call, obs, final = ex["turns"]
    assert text == (call["content"] + "<|im_end|>[observation]\n<|im_start|>user\n"
                    f"<tool_response>\n{obs['content']}\n</tool_response><|im_end|>\n"
                    f"<|im_start|>assistant\n[/observation]{final['content']}<|im_end|>")


# ----------------------------------------------------------------------------- the update

class _TextRows:
    def update_inputs(self, rows, layout, sample_prompts):
        return rows, None


def _rl(**kw):
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "runlocal")
    c.rl.update(**kw)
    return options.from_config(c).rl


def _setup(**rl_kw):
    from lrl.rl import update as upd
    ro = options.RolloutOptions(page_size=4, max_slots=8, pool_tokens=0, pool_fraction=0.4,
                                prefill_tokens=256, sp_min_tokens=0, narrow_decode=True,
                                overlap_admission=True, partial_backlog=0.0, partial=False,
                                partial_tokens=0, partial_tail=0.0, partial_seconds=0.0,
                                max_staleness=2, partial_keep_kv=True, env="test",
                                turn_reward="discount", turn_discount=0.5)
    return step_setup.Setup(rl=_rl(max_new_tokens=16, **rl_kw), rollout=ro, seed=5,
                            task=_TextRows(), tokenizer=None, model_cfg=TINY, mesh=None,
                            eos_ids=(1,), pool=None, update=None,
                            logprobs=upd.make_logprobs_fn(TINY, chunk=16), shards=1,
                            row_len=32, rows_per_shard=2, max_segments=8)


# Two trajectories of one prompt: model turn, observation, model turn (1 = model token).
MASKS = (np.array([1, 1, 1, 0, 0, 0, 0, 1, 1, 1], np.int8),
         np.array([1, 1, 0, 0, 1, 1, 1, 1], np.int8))


def _groups(obs_logp=0.0):
    rng = np.random.RandomState(0)
    prompts = (Prompt(rng.randint(2, 64, 6).astype(np.int32), "1", {}, ""),)
    comps = tuple(rng.randint(2, 64, m.size).astype(np.int32) for m in MASKS)
    logps = tuple(np.where(m > 0, -rng.rand(m.size), obs_logp).astype(np.float32)
                  for m in MASKS)
    return Groups(prompts, comps, logps, 2, np.zeros(2, bool),
                          rewards_PG=np.array([[1.0, 0.0]], np.float32), masks=MASKS)


@pytest.mark.parametrize("shared", ["off", "on"])
def test_rows_hold_the_trajectory_tokens_and_the_loss_mask_is_the_model_mask(shared):
    """Each trajectory's tokens are a segment's (after its prompt, held once for the group
    with the shared-prompt layout), the loss on the model's tokens alone."""
    s = _setup(shared_prompt=shared)
    g = _groups()
    rows, _, _ = grpo.pack(s, g, np.array([[1.0, -1.0]], np.float32), np.ones(2),
                           np.arange(2))
    seg = rows["segment_ids"]
    assert rows.get("prefix_ids", np.zeros(1)).any() == (shared == "on")
    for i, (c, m) in enumerate(zip(g.completions, MASKS)):
        # The segment that ends with completion i; its targets are the completion's tokens.
        hits = [(b, k) for b in range(seg.shape[0]) for k in range(1, seg[b].max() + 1)
                if np.array_equal(rows["tokens"][b][seg[b] == k][-c.size:], c)]
        assert len(hits) == 1, i
        b, k = hits[0]
        on = seg[b] == k
        n = on.sum()
        if shared == "off":
            np.testing.assert_array_equal(rows["tokens"][b][on][:n - c.size], g.prompts[0].ids)
        # Position t trains target t+1, in the shared layout too (a response segment is the
        # prompt's last token, then the response): the loss covers the model's tokens.
        at = slice(n - c.size - 1, n - 1)
        np.testing.assert_array_equal(rows["targets"][b][on][at], c)
        np.testing.assert_array_equal(rows["loss_mask"][b][on][at], m.astype(np.float32))
        np.testing.assert_array_equal(rows["response_pos"][b][on][at] > 0, m > 0)  # mismatch
        assert rows["loss_mask"][b][on].sum() == m.sum()


def test_gae_over_a_trajectory_skips_its_observations():
    """PPO on multi-turn rows (`rl.estimator="gae"` with `rollout.env`): the packed rows' loss
    mask (the model mask) is GAE's response mask, so each trajectory's advantages and returns
    on its model tokens are what GAE gives the model tokens alone, the observations taken out
    (verl's multi-turn GAE), and 0 on the observations; the outcome reward sits on the last
    model token."""
    import importlib
    gae = importlib.import_module("lrl.rl.gae")   # lrl.rl's `gae` is the padded function
    s = _setup()
    g = _groups()
    rows, _, _ = grpo.pack(s, g, np.array([[1.0, -1.0]], np.float32), np.ones(2), np.arange(2))
    seg, mask = rows["segment_ids"], rows["loss_mask"]
    rng = np.random.RandomState(1)
    values = rng.randn(*mask.shape).astype(np.float32)
    scores = np.zeros(mask.shape, np.float32)
    ends = {}
    for i, c in enumerate(g.completions):
        b, k = next((b, k) for b in range(seg.shape[0]) for k in range(1, seg[b].max() + 1)
                    if np.array_equal(rows["tokens"][b][seg[b] == k][-c.size:], c))
        scores[b][seg[b] == k] = g.rewards_PG[0, i]
        ends[i] = (b, k)
    gamma, lam = 0.9, 0.8
    rewards = gae.outcome_token_rewards(scores, mask, seg)
    adv, ret = (np.asarray(x) for x in gae.gae_packed(rewards, values, mask, seg, gamma, lam))
    for i, m in enumerate(MASKS):
        b, k = ends[i]
        on = (seg[b] == k) & (mask[b] > 0)
        assert on.sum() == m.sum()
        # the same sequence with its observations (and prompt) taken out: plain GAE
        v = values[b][on]
        r = np.zeros(v.size, np.float32)
        r[-1] = g.rewards_PG[0, i]
        want, last = np.zeros(v.size), 0.0
        for t in reversed(range(v.size)):
            nxt = v[t + 1] if t + 1 < v.size else 0.0
            last = r[t] + gamma * nxt - v[t] + gamma * lam * last
            want[t] = last
        np.testing.assert_allclose(adv[b][on], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret[b][on], want + v, rtol=1e-5, atol=1e-5)
        off = (seg[b] == k) & (mask[b] == 0)
        assert off.any() and not adv[b][off].any()
    o = options.from_config(_tools_config(estimator="gae"), check_files=False)
    assert o.rl.uses_critic and o.rollout.env == "tools"


def _tools_config(**rl_kw):
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "tools")
    c.rl.update(**rl_kw)
    return c


def test_observation_tokens_get_no_gradient_and_no_share_in_the_update():
    """The same update whatever the sampler's log-probs of the observation tokens (the
    scheduler gives 0.0; any other value changes nothing), the mismatch metrics over the
    model's tokens alone, and the loss's gradient with respect to each position's log-prob
    exactly 0 where the target is an observation token."""
    import optax
    from lrl.rl import LossConfig, policy_loss
    from lrl.rl import update as upd
    tx = optax.sgd(1.0)
    s = dataclasses.replace(_setup(minibatches=1),
                            update=upd.make_update_programs(TINY, LossConfig(), tx, chunk=16))
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x,
                          models.init_params(TINY, jax.random.key(1)))
    host = jax.tree.map(np.asarray, params)
    adv, w = np.array([[1.0, -1.0]], np.float32), np.ones(2, np.float32)
    out = []
    for obs in (0.0, -30.0):
        state = upd.init_train_state(jax.tree.map(jax.numpy.array, host), tx)
        batches, _ = grpo.minibatches(s, _groups(obs), adv, w)
        new, m = grpo.updates(s, state, batches)
        out.append((jax.tree.map(np.asarray, new.params), m))
    (p0, m0), (p1, m1) = out
    assert m0["mismatch/tokens"] == sum(int(m.sum()) for m in MASKS) == 12
    for k in ("loss", "grad_norm", "mismatch/abs_mean"):
        np.testing.assert_allclose(m0[k], m1[k], rtol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(p0), jax.tree.leaves(host)))   # it did learn
    # d loss / d logp per position, on the packed rows
    mb = batches[0].micro[0]
    mask = np.asarray(mb["loss_mask"])
    seq_adv = np.asarray(mb["advantages"]).max(axis=1)
    logp = jax.numpy.asarray(np.asarray(mb["old_logp"]) - 0.1)
    grad = jax.grad(lambda lp: policy_loss(lp, mb["old_logp"], seq_adv, mask,
                                           aggregation="token_mean")[0])(logp)
    grad = np.asarray(grad)
    assert (grad[mask == 0] == 0).all() and (grad[mask > 0] != 0).all()
    obs_targets = (np.asarray(mb["segment_ids"]) > 0) & (mask == 0) & (
        np.asarray(mb["response_pos"]) == 0)
    assert obs_targets.sum() > 0


# ----------------------------------------------------------------------------- rewards

def test_trajectory_reward_sums_or_discounts_the_turns():
    assert trajectories.trajectory_reward([0.5, 0.0, 1.0], "sum", 0.9) == 1.5
    assert trajectories.trajectory_reward([0.5, 0.0, 1.0], "discount", 0.5) == 0.75
    assert trajectories.trajectory_reward([], "sum", 1.0) == 0.0
    with pytest.raises(ValueError, match="rollout.turn_reward='mean'"):
        trajectories.trajectory_reward([1.0], "mean", 1.0)


@dataclasses.dataclass
class _Traj:   # the contract's lrl.envs.driver.Trajectory
    reward: float
    turn_rewards: list
    turns: int
    tool_calls: int
    tool_errors: int
    timeouts: int
    tool_s: float
    end: str


class _Res:   # the contract's rollout.Result
    def __init__(self, samples, masks, ends):
        self.samples, self.model_masks, self.ends = samples, masks, ends


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


def test_groups_of_trajectories_score_the_model_text_and_add_the_turn_rewards():
    s = _setup()
    enc = lambda t: np.array([ord(c) for c in t], np.int32)  # noqa: E731
    # Sample 1 only reads the answer's box in an observation (its text is the model's).
    parts0 = [("call|", 1), ("obs 7|", 0), ("\\boxed{7}", 1)]
    parts1 = [("call|", 1), ("\\boxed{7}|", 0), ("\\boxed{3}", 1)]  # the box was observed
    t0, t1 = ("".join(t for t, _ in p) for p in (parts0, parts1))
    m0, m1 = (np.concatenate([np.full(len(t), k, np.int8) for t, k in p])
              for p in (parts0, parts1))
    res = _Res([[(enc(t0), np.zeros(len(t0))), (enc(t1), np.zeros(len(t1)))]],
               [[m0, m1]], [["stop", "length"]])
    trajs = {(0, 0): _Traj(0.0, [0.2, 1.0], 2, 1, 0, 0, 0.01, "done"),
             (0, 1): _Traj(0.0, [0.0, 0.0], 2, 1, 1, 0, 0.02, "max_turns")}
    stats = {}
    prompts = [Prompt(np.arange(3, dtype=np.int32), "7", {}, "")]
    g = trajectories.groups_of(s, prompts, 2, res, trajs, {"env/calls": 2}, stats)
    assert stats == {"env_calls": 2}
    assert g.truncated.tolist() == [False, True]
    assert [t["end"] for t in g.trajectories] == ["done", "length"]
    scored, _ = collect.score(g, None, _Tok())   # the environment scored them: no pool
    # 0.2 + 0.5 * 1.0 (turn_discount 0.5), the final answer's reward the last turn's
    np.testing.assert_allclose(scored.rewards_PG, [[0.7, 0.0]], rtol=1e-6)
    assert scored.texts[1] == "call|\\boxed{3}"
    m = collect.rollout_metrics(scored)
    assert m["turns/turns_mean"] == 2 and m["turns/tool_errors_mean"] == 0.5
    assert m["turns/observed_tokens"] == int((m0 == 0).sum() + (m1 == 0).sum())
    assert m["turns/end_done_frac"] == 0.5
    # Taking and joining keep each sample's mask and record with it.
    both = Groups.concat([scored, scored.take(np.array([True]))])
    assert len(both.masks) == 4 and both.masks[3] is m1 and both.trajectories[2]["end"] == "done"
    with pytest.raises(ValueError, match=r"sample \(0, 1\) has 24 tokens but a model mask of 3"):
        trajectories.groups_of(s, prompts, 2, _Res(res.samples, [[m0, m1[:3]]], res.ends),
                               trajs, {}, None)


def test_tools_config_checks_what_multi_turn_does_not_run_with():
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "tools")
    o = options.from_config(c, check_files=False)
    assert o.rollout.env == "tools" and o.data.task == "tool_lookup"
    c.rollout.partial = True   # trajectories carried across steps (lrl.partial_turns)
    assert options.from_config(c, check_files=False).rollout.partial
    c.pipeline.rollout_devices = 1
    with pytest.raises(ValueError, match="rollout.env='tools' is not built with "
                                         "pipeline.rollout_devices > 0"):
        options.from_config(c, check_files=False)
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "tools")
    c.rollout.max_turn_tokens = 1000
    with pytest.raises(ValueError, match="rollout.max_turn_tokens=1000 > rl.max_new_tokens"):
        options.from_config(c, check_files=False)
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "tools")
    c.rollout.env = "toolz"
    with pytest.raises(ValueError, match="rollout.env='toolz': unknown environment"):
        options.from_config(c, check_files=False)


# ----------------------------------------------------------------------------- exact tokens

from lrl.envs import base as env_base   # noqa: E402


@env_base.register("test_always_answers")
class _AlwaysAnswers(env_base.Environment):
    """Answers every model turn with the same tool result; the driver's max_turns ends it."""
    role = "tool"

    def step(self, turn_text, turn_tokens):
        return env_base.Step("42", 0.0, False, {"tool_calls": 1})


def _bigram_params(cfg, chain: dict, seed: int = 0):
    """Weights whose greedy next token is `chain[current token]`: the layers add nothing to
    the residual stream (zero output projections), so the logits read the current token's
    embedding alone through an lm head that maps it to its successor."""
    params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.key(seed)))
    params["layers"]["o_proj"]["kernel"] = np.zeros_like(params["layers"]["o_proj"]["kernel"])
    params["layers"]["down_proj"]["kernel"] = np.zeros_like(
        params["layers"]["down_proj"]["kernel"])
    rng = np.random.RandomState(seed)
    emb = rng.randn(cfg.vocab_size, cfg.d_model).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros((cfg.d_model, cfg.vocab_size), np.float32)
    for cur, nxt in chain.items():
        head[:, nxt] += 0.5 * emb[cur]   # a clear argmax, log-probs far from 0
    params["embed"]["embedding"], params["lm_head"] = emb, head
    return jax.tree.map(jax.numpy.asarray, params)


def test_the_update_sees_the_engines_tokens_turn_by_turn_never_a_rerendering(tool_tok):
    """Three model turns, each thinking then calling a tool, with the tool's answers between
    them, sampled by the engine (the scheduler pauses each trajectory for the driver's
    environment step and prefills the observation after it): the rows the update trains
    hold exactly the sampled turns and the inserted observations, turn by turn, with the loss
    on the model's turns only and the sampler's log-probs those of the trainer's forward. The
    template drops earlier <think> blocks, so rendering the conversation again would not."""
    tok = tool_tok
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    nl, eos = ids("\n")[0], tok.eos_token_id
    turn = [tok.convert_tokens_to_ids("<think>"), ids("a")[0],
            tok.convert_tokens_to_ids("</think>"), tok.convert_tokens_to_ids("<tool_call>"),
            ids("b")[0], tok.convert_tokens_to_ids("</tool_call>"), eos]
    chain = dict(zip([nl] + turn[:-1], turn))
    cfg = models.ModelConfig(model_type="qwen2", vocab_size=len(tok), d_model=64, n_layers=1,
                             n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=64, remat="none",
                             tie_embeddings=False)
    params = _bigram_params(cfg, chain)
    from lrl.envs.render import observation_ids
    from lrl.rl import update as upd
    obs = observation_ids(tok, [{"role": "tool", "content": "42"}], last_token=eos,
                          end_ids=(eos,))
    assert obs[-1] == nl          # the next assistant header ends as the prompt's does
    s = dataclasses.replace(
        _setup(), tokenizer=tok, model_cfg=cfg, eos_ids=(eos,), row_len=128,
        rl=_rl(max_new_tokens=96, temperature=0.0, minibatches=1),
        logprobs=upd.make_logprobs_fn(cfg, chunk=64),
        rollout=dataclasses.replace(_setup().rollout, env="test_always_answers", max_turns=3,
                                    turn_reward="sum"))
    messages = [{"role": "user", "content": "Look up key ab."}]
    prompt_ids = np.asarray(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False), np.int32)
    prompts = [Prompt(prompt_ids, "42", {}, "")]
    stats = {}
    g = collect.rollout_groups(s, params, prompts, group_size=2, seed=0, stats=stats)
    want = turn + obs + turn + obs + turn
    want_mask = [1] * 7 + [0] * len(obs) + [1] * 7 + [0] * len(obs) + [1] * 7
    for c, m, rec in zip(g.completions, g.masks, g.trajectories):
        assert c.tolist() == want and m.tolist() == want_mask
        assert rec["turns"] == 3 and rec["end"] == "max_turns" and rec["tool_calls"] == 3
    assert stats["env_end_max_turns"] == 2 and stats["env_observed_tokens"] == 4 * len(obs)
    # The rows of the update: prompt + trajectory, token for token, the loss on model turns.
    g, _ = collect.score(g, None, tok)
    batches, _ = grpo.minibatches(s, g, np.array([[1.0, -1.0]], np.float32), np.ones(2))
    mb = batches[0].micro[0]
    seg, P = np.asarray(mb["segment_ids"]), len(prompt_ids)
    held = [(b, k) for b in range(seg.shape[0]) for k in range(1, seg[b].max() + 1)]
    assert len(held) == 2
    # The sampler's log-probs of the model's tokens are the trainer's on those rows (0.0 on
    # the observations, which the sampler did not draw).
    trainer = np.asarray(s.logprobs(params, mb, None))
    for i, (b, k) in enumerate(held):
        on = seg[b] == k
        assert np.asarray(mb["tokens"])[b][on].tolist() == prompt_ids.tolist() + want
        np.testing.assert_array_equal(np.asarray(mb["loss_mask"])[b][on][P - 1:-1], want_mask)
        model = np.asarray(want_mask) > 0
        assert (g.logps[i][~model] == 0).all() and (g.logps[i][model] < -0.1).all()
        np.testing.assert_allclose(trainer[b][on][P - 1:-1][model], g.logps[i][model],
                                   atol=1e-4)
    # The conversation rendered again drops the first two turns' thinking: other tokens.
    text = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    convo = messages + [
        {"role": "assistant", "content": text(turn[:-1])}, {"role": "tool", "content": "42"},
        {"role": "assistant", "content": text(turn[:-1])}, {"role": "tool", "content": "42"},
        {"role": "assistant", "content": text(turn[:-1])}]
    again = tok.apply_chat_template(convo, tokenize=True, return_dict=False)
    assert again[:len(prompt_ids)] == prompt_ids.tolist()
    assert again[len(prompt_ids):][:len(want)] != want
    assert again.count(turn[0]) == 1 and want.count(turn[0]) == 3


@pytest.mark.slow
def test_tools_runlocal_runs_multi_turn_through_the_one_loop(tmp_path):
    """`configs/default.py:tools_runlocal`: the tokenizer with the tool tokens, the SFT warm
    start on whole conversations, multi-turn GRPO steps and held-out evals through the
    reward pool's workers, checkpoints; every step reports its trajectories."""
    from lrl import loop
    c = config_util.load(os.path.join(ROOT, "configs", "default.py"), "tools_runlocal")
    c.mesh.update(fsdp=4, tensor=2)   # the suite's 8 devices
    m = loop.run(c, str(tmp_path))["grpo"]
    assert m["rollout/env_trajectories"] == 4 * 4 and m["turns/turns_mean"] >= 1
    assert m["turns/generated_tokens"] > 0 and "eval/pass@4" in m and np.isfinite(m["loss"])
    tok = tok_lib.load_tokenizer(str(tmp_path / "tokenizer"))
    assert tok.convert_tokens_to_ids("<tool_call>") == 314   # vocab_size - 6
    # samples.jsonl shows the whole trajectory; any tool answer inside observation marks.
    import json
    recs = [json.loads(x) for x in open(tmp_path / "samples.jsonl")]
    assert recs and all(r["trajectory"].startswith(r["completion"][:1]) for r in recs)
    assert all(r["trajectory"].count("[observation]") == r["trajectory"].count(
        "<tool_response>") for r in recs)
