"""PPO's critic and its pass in the step: sharded (fsdp x seq, ring and Ulysses) equals
unsharded for the critic's values and its update; value steps lower the loss; the old values
and GAE read the same packed rows whether a group's prompt is shared or not; the KL in the
reward per sample; the options' cross-field errors; and a PPO run end to end, resumed after a
SIGTERM exactly as it would have gone on, compiling nothing after its second step."""
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lrl.models as models
from lrl import checkpoint as ckpt_lib
from lrl import grpo, loop, ppo
from lrl import mesh as mesh_lib
from lrl import metrics as metrics_lib
from lrl import options as options_lib
from lrl.data import packing, shared_prompt
from lrl.rl import critic
from lrl.rl.update import host_denominators
from tests.hf_util import rel_err
from tests.test_loop import tiny_config

CFG = models.tiny_config(model_type="qwen3", qk_norm=True, vocab_size=96, d_model=32,
                         n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, n_layers=2)


def _rows(rng, n=6, row_len=32, rows=4, shared=False, share_groups=False):
    """Packed rows of `n` samples in groups of 3 (prompts 6-12 tokens, completions 3-9) with
    their critic inputs: old values and returns at random, the rewards as `score`."""
    G = 3
    prompts = [list(rng.integers(1, CFG.vocab_size, int(rng.integers(6, 13))))
               for _ in range(n // G)]
    ids = [prompts[i // G] for i in range(n)]
    comps = [list(rng.integers(1, CFG.vocab_size, int(rng.integers(3, 10)))) for _ in range(n)]
    token_values = {k: [rng.normal(size=len(c)).astype(np.float32) for c in comps]
                    for k in ("old_values", "returns")}
    seq_values = {}
    ppo.pack_values(np.arange(n), rng.random(n).astype(np.float32), comps, token_values,
                    seq_values)
    kw = dict(seq_values=seq_values, token_values=token_values, rows_multiple=rows)
    if shared:
        groups = np.arange(n) // G
        batch, layout = shared_prompt.pack_groups(ids, comps, row_len, groups=groups,
                                                  share=np.full(n, share_groups), **kw)
    else:
        batch, layout = packing.pack(ids, comps, row_len, fit="best", **kw)
    assert batch["tokens"].shape[0] % rows == 0
    return batch, layout


def _critic_params(cfg, seed=1):
    policy = models.init_params(cfg, jax.random.key(seed))
    return critic.params_from_policy(critic.critic_config(cfg), policy, head_std=0.3, seed=seed)


@pytest.mark.parametrize("attention,seq", [pytest.param("ring", 2, marks=pytest.mark.slow),
                                           pytest.param("ring", 4, marks=pytest.mark.slow),
                                           ("ulysses", 2)])
def test_sharded_critic_equals_unsharded(attention, seq):
    rng = np.random.default_rng(0)
    batch, _ = _rows(rng)
    denoms = host_denominators([batch])
    ccfg = critic.critic_config(CFG)
    params = _critic_params(CFG)
    tx = optax.sgd(1.0)   # one step: the parameters move by minus the gradient

    def one_step(cfg, mesh):
        c = critic.make_programs(cfg, tx, mesh, cliprange_value=0.2, aggregation="token_mean")
        state = critic.init_state(cfg, jax.tree.map(jnp.array, params), tx, mesh)
        mb = mesh_lib.put_batch(mesh, batch) if mesh is not None else batch
        values = np.asarray(critic.old_values(c, state.params, mb))
        new, metrics = critic.run_update(c, state, [mb], denoms)
        delta = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new.params, params)
        return values, delta, jax.device_get(metrics)

    v0, d0, m0 = one_step(ccfg, None)
    mesh = mesh_lib.make_mesh({"seq": seq, "fsdp": -1})
    v1, d1, m1 = one_step(ccfg.replace(attention=attention), mesh)
    on = batch["loss_mask"] > 0
    assert rel_err(v1[on], v0[on]) < 1e-5
    assert 0.05 < m0["vf_clipfrac"] < 0.95          # both the clipped and the plain term
    for k in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm"):
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, err_msg=k)
    assert float(np.abs(d0["score_DL"]).max()) > 1e-3 and \
        float(np.abs(d0["decoder"]["embed"]["embedding"]).max()) > 1e-6   # both moved
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(d1)[0], jax.tree.leaves(d0)):
        assert rel_err(a, b) < 1e-4, jax.tree_util.keystr(path)


def test_value_steps_lower_the_value_loss():
    rng = np.random.default_rng(1)
    batch, _ = _rows(rng)
    batch["old_values"] = np.zeros_like(batch["old_values"])
    denoms = host_denominators([batch])
    ccfg = critic.critic_config(CFG)
    tx = optax.adam(1e-2)
    c = critic.make_programs(ccfg, tx, None, cliprange_value=10.0, aggregation="token_mean")
    state = critic.init_state(ccfg, _critic_params(CFG), tx)
    losses = []
    for _ in range(15):
        state, m = critic.run_update(c, state, [batch], denoms)
        losses.append(float(m["vf_loss"]))
    # the loss is 0.5 x the mean squared error to the returns (no clip at 10)
    v = np.asarray(critic.old_values(c, state.params, batch))
    on = batch["loss_mask"] > 0
    final = 0.5 * np.mean((v[on] - batch["returns"][on]) ** 2)
    assert final < 0.5 * losses[0], (losses, final)


def _ppo(**rl):
    cfg = tiny_config(**rl)
    opts = options_lib.from_config(cfg, check_files=False)
    return opts, ppo.build(opts, CFG, None, aggregation="token_mean")


def test_old_values_and_gae_read_shared_rows_as_plain_ones():
    """The critic's values, and GAE's advantages and returns from them, per completion token,
    are the same whether a group's prompt is held once in a row (rl.shared_prompt) or not."""
    opts, p = _ppo(estimator="gae", lam=0.95, gamma=0.99)
    ccfg = critic.critic_config(CFG)
    tx = optax.sgd(0.1)
    p.critic = critic.make_programs(ccfg, tx, None, cliprange_value=0.5,
                                    aggregation="token_mean")
    p.state = critic.init_state(ccfg, _critic_params(CFG), tx)
    out = []
    for share in (False, True):
        batch, layout = _rows(np.random.default_rng(2), shared=True, share_groups=share)
        assert share == bool(batch["prefix_ids"].any())
        mb = ppo.old_values(p, {k: v for k, v in batch.items()
                                if k not in ("old_values", "returns")}, None)
        b = grpo.Minibatch([mb], host_denominators([batch]), None, 0, 0)
        (b,), m = ppo.gae_advantages(p, [b])
        mb = b.micro[0]
        out.append([packing.completion_values(np.asarray(mb[k]), layout)
                    for k in ("old_values", "advantages", "returns")])
    for plain, shared in zip(*out):
        for a, b in zip(plain, shared):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    # GAE by hand for the first completion (gamma, lam; reward on its last token)
    values, _, returns = (x[0] for x in out[0])
    score = packing.completion_values(_rows(np.random.default_rng(2), shared=True)[0]["score"],
                                      _rows(np.random.default_rng(2), shared=True)[1])[0]
    adv, last = np.zeros(len(values)), 0.0
    for t in reversed(range(len(values))):
        nxt = values[t + 1] if t + 1 < len(values) else 0.0
        last = score[t] + 0.99 * nxt - values[t] + 0.99 * 0.95 * last
        adv[t] = last
    np.testing.assert_allclose(returns, adv + values, rtol=1e-5, atol=1e-5)


def test_kl_in_the_reward_of_an_outcome_estimator_is_per_sample():
    opts, p = _ppo(kl_in_reward=True)
    assert p.critic is None and opts.rl.old_logp != "none"   # the KL reads old log-probs
    rng = np.random.default_rng(3)
    batch, layout = _rows(rng)
    old = rng.normal(size=batch["tokens"].shape).astype(np.float32) - 2.0
    ref = old + rng.normal(scale=0.1, size=old.shape).astype(np.float32)
    mb = {**batch, "old_logp": old, "ref_logp": ref}
    b = grpo.Minibatch([mb], None, None, 0, 0)
    sums, m = ppo.sample_kl_sums(p, [b], 6)
    # k1 (verl's "kl"): old - ref over each sample's response tokens
    want = [np.sum(o - r) for o, r in zip(packing.completion_values(old, layout),
                                          packing.completion_values(ref, layout))]
    np.testing.assert_allclose(sums, want, rtol=1e-5, atol=1e-5)
    per_seq = [np.mean(o - r) for o, r in zip(packing.completion_values(old, layout),
                                              packing.completion_values(ref, layout))]
    assert m["kl_in_reward/kl"] == pytest.approx(np.mean(per_seq), rel=1e-5)
    adv = np.arange(6, dtype=np.float32) - 2.5
    (b,) = ppo.outcome_advantages(p, [b], adv)
    for i, x in enumerate(packing.completion_values(np.asarray(b.micro[0]["advantages"]),
                                                    layout)):
        np.testing.assert_array_equal(x, np.full(len(x), adv[i], np.float32))
    # and the coefficient moves with the adaptive controller, not with the fixed one
    before = p.kl_coef
    ppo.end_step(p, m, 6)
    assert p.kl_coef == before and p.steps == 1


@pytest.mark.parametrize("change,key", [
    (dict(critic=dict(warmup_steps=2)), "critic.warmup_steps"),
    (dict(rl=dict(estimator="gae"), pipeline=dict(rollout_devices=2)), "rl.estimator"),
    (dict(rl=dict(estimator="gae", loss=dict(ratio_level="sequence"))), "ratio_level"),
    (dict(rl=dict(kl_ctrl=dict(type="pid"))), "rl.kl_ctrl.type"),
])
def test_ppo_options_name_the_culprit(change, key):
    cfg = tiny_config()
    for section, fields in change.items():
        for k, v in fields.items():
            if isinstance(v, dict):
                cfg[section][k].update(v)
            else:
                cfg[section][k] = v
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        options_lib.from_config(cfg, check_files=False)


def _ppo_config():
    cfg = tiny_config(estimator="gae", kl_in_reward=True, lam=0.95)
    cfg.rl.steps = 4
    cfg.rl.kl_ctrl.update(type="adaptive", horizon=100)
    cfg.critic.update(warmup_steps=1, cliprange_value=0.5)
    cfg.critic.optim.lr = 1e-3
    cfg.eval.every = 0
    cfg.reward.spec = "test_digits:1.0"   # rewards that vary within groups
    return cfg


def _saved(workdir, item):
    """A checkpoint item's arrays as saved (numpy), from the newest step."""
    import orbax.checkpoint as ocp
    root = os.path.join(workdir, "checkpoints")
    step = ckpt_lib.CheckpointManager(root).all_steps()[-1]
    return ocp.PyTreeCheckpointer().restore(os.path.join(root, str(step), item))


@pytest.mark.slow
def test_ppo_runs_end_to_end_resumes_exactly_and_compiles_nothing_after_step_two(
        tmp_path, monkeypatch):
    cfg = _ppo_config()
    loop.run(cfg, str(tmp_path / "straight"))
    rows = [json.loads(line) for line in
            (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "compiles/step" in r]
    assert len(steps) == 4
    assert [r["compiles/step"] for r in steps[2:]] == [0, 0], [r["compiles/step"] for r in steps]
    assert "loss" not in steps[0] and all("loss" in r for r in steps[1:])   # critic warm-up
    for r in steps:
        assert np.isfinite(r["critic/vf_loss"]) and r["advantage/tokens"] > 0
        assert r["kl_in_reward/coef"] > 0 and "time/critic_s" in r
    coefs = [r["kl_in_reward/coef"] for r in steps]
    assert len(set(coefs)) > 1   # the adaptive controller moved it

    write = metrics_lib.MetricsWriter.write

    def write_then_sigterm(self, step, metrics, phase="grpo"):
        scalars = write(self, step, metrics, phase)
        if step == 5:   # the second PPO step (3 SFT steps first)
            os.kill(os.getpid(), signal.SIGTERM)
        return scalars

    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_then_sigterm)
    loop.run(cfg, str(tmp_path / "cut"))
    assert ckpt_lib.CheckpointManager(tmp_path / "cut" / "checkpoints").all_steps()[-1] == 5
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write)
    loop.run(cfg, str(tmp_path / "cut"))   # resumes at step 6
    cut = [json.loads(line) for line in
           (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in cut] == [r["step"] for r in rows]
    for a, b in zip([r for r in cut if "compiles/step" in r][2:], steps[2:]):
        for k in ("critic/vf_loss", "critic/values_mean", "kl_in_reward/coef",
                  "kl_in_reward/kl", "loss", "reward/mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    # step 6's coefficient is the one step 5's checkpoint kept (compared above); the arrays:
    for item in ("state", "critic"):
        a, b = (_saved(str(tmp_path / w), item) for w in ("cut", "straight"))
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["tok", "seq"])
def test_critic_from_a_hf_score_checkpoint_gives_its_scores(tmp_path, kind):
    """critic.hf_path: a Qwen2 *ForTokenClassification (with its head's bias) or
    *ForSequenceClassification (none) checkpoint; the critic's value at every position is
    the checkpoint's per-token score as transformers computes it."""
    from tests.test_score import make_score_model, torch_logits
    model = make_score_model("qwen2", kind, tmp_path)
    ccfg = critic.critic_config(models.from_hf_dir(str(tmp_path)))
    params = ppo._load_hf_critic(str(tmp_path), ccfg, None)
    tokens = np.random.default_rng(0).integers(1, 128, (2, 12)).astype(np.int32)
    mb = {"tokens": tokens, "positions": np.tile(np.arange(12, dtype=np.int32), (2, 1)),
          "segment_ids": np.ones_like(tokens)}
    v = np.asarray(critic.values(ccfg, params, mb))
    want = torch_logits(model, tokens)[..., 0]
    if kind == "seq":   # the sequence head reads the last token (no padding here)
        v = v[:, -1]
    assert rel_err(v, want) < 1e-4
    assert (kind == "tok") == bool(np.any(np.asarray(params["score_L"])))
