"""The reward-model term: conversations rendered in the RM's own template, packed, scored on
the mesh, equal to transformers' AutoModelForSequenceClassification; weighted with rule terms;
clear errors for a wrong checkpoint or config."""
import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers

from lrl import mesh as mesh_lib
from lrl.data import synthetic, tokenizer as tok_lib
from lrl.options import RewardModelOptions
from lrl.rewards import RewardPool
from lrl.rewards import model as rm_lib

VOCAB = 300


def _hf_config(family, **kw):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  initializer_range=0.1, pad_token_id=0, num_labels=1, **kw)
    if family == "llama":
        return transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=8, tie_word_embeddings=False, **common)
    return transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=4,
                                    tie_word_embeddings=True, **common)


def make_rm(family, path, seed=0):
    """A random HF sequence classifier and a chat tokenizer in `path`; the torch model."""
    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaForSequenceClassification,
           "qwen2": transformers.Qwen2ForSequenceClassification}[family]
    model = cls(_hf_config(family)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    tok_lib.build_tokenizer(synthetic.synthetic_corpus(200, seed=1), VOCAB, out_dir=str(path))
    return model


def _opts(path, **kw):
    return RewardModelOptions(**{**dict(hf_path=str(path), tokenizer_path="", max_len=128,
                                        batch_rows=4, dtype="float32"), **kw})


def _conversations(n, seed=0):
    rng = np.random.RandomState(seed)
    words = ["seven", "plus", "two", "is", "nine", "the", "answer", "\\boxed{9}", "no"]
    msgs = [[{"role": "user", "content": " ".join(rng.choice(words, rng.randint(2, 8)))}]
            for _ in range(n)]
    msgs[0] = [{"role": "system", "content": "be brief"}, *msgs[0]]
    responses = [" ".join(rng.choice(words, rng.randint(1, 12))) for _ in range(n)]
    return msgs, responses


def _transformers_scores(model, tokenizer, msgs, responses):
    out = []
    for m, r in zip(msgs, responses):
        text = tokenizer.apply_chat_template([*m, {"role": "assistant", "content": r}],
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return np.asarray(out, np.float32)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def rm_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"rm_{request.param}")
    return path, make_rm(request.param, path)


@pytest.mark.parametrize("sizes,attention", [(None, "dense"), ({"fsdp": 4, "seq": 2}, "ring")])
def test_scores_equal_transformers(rm_dir, sizes, attention):
    path, model = rm_dir
    mesh = None if sizes is None else mesh_lib.make_mesh(sizes)
    rm = rm_lib.load(_opts(path), mesh, attention=attention)
    msgs, responses = _conversations(13)
    ours, stats = rm_lib.score(rm, msgs, responses)
    want = _transformers_scores(model, rm.tokenizer, msgs, responses)
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=1e-4)
    # 13 conversations of 30-80 tokens pack several to a 128-token row, over more than one
    # call of 4 rows (the last padded with empty rows).
    assert stats["rm_rows"] < 13 and stats["rm_calls"] >= 2 and stats["rm_truncated"] == 0
    # The system turn of the first conversation is in its rendering.
    assert "be brief" in rm.tokenizer.decode(rm_lib.render(rm, msgs[0], responses[0]))


def test_truncation_is_counted(rm_dir):
    path, _ = rm_dir
    rm = rm_lib.load(_opts(path, max_len=16, batch_rows=1), None)
    msgs, responses = _conversations(3, seed=1)
    scores, stats = rm_lib.score(rm, msgs, responses)
    assert stats["rm_truncated"] == 3 and np.isfinite(scores).all()


def test_pool_weighs_rm_with_rule_terms(rm_dir):
    path, _ = rm_dir
    rm = rm_lib.load(_opts(path), None)
    rules, weight = rm_lib.split_spec("exact:0.5,rm:0.25")
    assert weight == 0.25 and [r[:2] for r in rules] == [("exact", 0.5)]
    msgs, responses = _conversations(6, seed=2)
    answers = responses[:3] + ["zzz"] * 3  # 3 right, 3 wrong
    items = [(r, a, {"messages": m, "task": "t"}) for r, a, m in zip(responses, answers, msgs)]
    with rm_lib.ModelRewardPool(RewardPool(rules, num_workers=0), rm, weight) as pool:
        got, stats = pool.score(items)
    rule, _ = RewardPool("exact:0.5", num_workers=0).score(
        [(r, a) for r, a, _ in items])
    rm_only, _ = rm_lib.score(rm, msgs, responses)
    np.testing.assert_allclose(got, rule + 0.25 * rm_only, atol=1e-6)
    assert rule.min() == 0 and rule.max() == 0.5   # both outcomes of the rule term occur
    assert stats["term_mean/rm"] == pytest.approx(float(rm_only.mean()))
    assert "messages" in items[0][2]   # the caller's meta is left as it was
    with pytest.raises(ValueError, match="has no 'messages'"):
        rm_lib.ModelRewardPool(None, rm, 1.0).score([("x", "y", {})])


def test_bad_checkpoints_are_clear_errors(tmp_path, rm_dir):
    path, _ = rm_dir
    with pytest.raises(FileNotFoundError, match="reward.model.hf_path='/nope'"):
        rm_lib.check(_opts("/nope"))
    from tests.hf_util import make_hf_model
    make_hf_model("qwen2", tmp_path / "lm")
    with pytest.raises(ValueError, match=r"reward.model.hf_path: .*config.json has "
                                         r"architectures=\['Qwen2ForCausalLM'\]"):
        rm_lib.check(_opts(tmp_path / "lm"))
    two = tmp_path / "two"
    transformers.Qwen2ForSequenceClassification(
        _hf_config("qwen2") .__class__(**{**_hf_config("qwen2").to_dict(), "num_labels": 2})
    ).save_pretrained(str(two))
    with pytest.raises(ValueError, match=r"score.weight has shape \[2, 32\]"):
        rm_lib.check(_opts(two))
    with pytest.raises(FileNotFoundError, match="reward.model.tokenizer_path='/no/tok'"):
        rm_lib.check(_opts(path, tokenizer_path="/no/tok"))
    with pytest.raises(ValueError, match="reward.model.batch_rows=3 is not a multiple"):
        rm_lib.load(_opts(path, batch_rows=3), mesh_lib.make_mesh({"fsdp": 2, "data": 4}))


def test_a_trajectory_is_scored_as_its_whole_conversation(rm_dir):
    """Multi-turn (`rollout.env`): a reward model scores the prompt's messages, each model
    turn as an assistant message and each observation as the messages its environment
    returned, in the RM's own template, as transformers scores that conversation; weighted
    and added to the environment's reward."""
    from lrl import collect, trajectories
    from lrl.groups import Groups
    from lrl.tasks import Prompt
    path, model = rm_dir
    rm = rm_lib.load(_opts(path, max_len=256), None)
    tok = rm.tokenizer   # the policy's tokenizer too
    enc = lambda t: np.asarray(tok(t, add_special_tokens=False)["input_ids"], np.int32)  # noqa
    msgs, _ = _conversations(2, seed=3)
    turns = [[("seven plus two", 1), ("<|im_end|>\n<|im_start|>tool\n9<|im_end|>\n", 0),
              ("the answer is nine", 1)],
             [("no", 1)]]
    observations = [[[{"role": "tool", "content": "9"}]], []]
    completions = [np.concatenate([enc(t) for t, _ in p]) for p in turns]
    masks = [np.concatenate([np.full(len(enc(t)), k, np.int8) for t, k in p]) for p in turns]
    recs = [{"env_reward": 1.0, "observations": observations[0]},
            {"env_reward": 0.0, "observations": observations[1]}]
    prompts = tuple(Prompt(np.arange(3, dtype=np.int32), "9", {"messages": m}, "") for m in msgs)
    groups = Groups(prompts, tuple(completions), tuple(np.zeros(len(c)) for c in completions),
                    1, np.zeros(2, bool), masks=tuple(masks), trajectories=tuple(recs))
    chats = [trajectories.conversation(tok, c, m, r["observations"])
             for c, m, r in zip(completions, masks, recs)]
    assert chats[0] == [{"role": "assistant", "content": "seven plus two"},
                        {"role": "tool", "content": "9"},
                        {"role": "assistant", "content": "the answer is nine"}]
    with rm_lib.ModelRewardPool(None, rm, 0.5) as pool:
        scored, stats = collect.score(groups, pool, tok)
    want = []
    for m, chat in zip(msgs, chats):
        ids = tok(tok.apply_chat_template([*m, *chat], tokenize=False), add_special_tokens=False,
                  return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want.append(float(model(input_ids=ids).logits[0, 0]))
    np.testing.assert_allclose(scored.rewards_PG[:, 0], np.asarray([1.0, 0.0]) + 0.5 * np.asarray(
        want), atol=1e-4, rtol=1e-4)
    assert stats["reward/term_mean/rm"] == pytest.approx(np.mean(want), abs=1e-4)
    assert scored.texts[0] == "seven plus twothe answer is nine"   # the model's tokens
    # A record from before observations were kept: its observation run decoded as a tool turn.
    old = trajectories.conversation(tok, completions[0], masks[0], [])
    assert old[1]["role"] == "tool" and "9" in old[1]["content"]


def test_config_rules(tmp_path, rm_dir):
    from configs import default
    from lrl import options
    c = default.get_config()
    c.reward.spec = "synthetic:1.0,rm:0.5"
    with pytest.raises(ValueError, match="'rm' term but reward.model.hf_path is empty"):
        options.from_config(c, check_files=False)
    c = default.get_config()
    c.reward.model.hf_path = str(tmp_path)
    with pytest.raises(ValueError, match="has no 'rm' term"):
        options.from_config(c, check_files=False)
    c.reward.spec = "synthetic:1.0,rm:0.5"
    o = options.from_config(c, check_files=False)
    assert dataclasses.asdict(o.reward.model)["max_len"] == 4096
    c.reward.model.hf_path = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="reward.model.hf_path="):
        options.from_config(c)
    # The file checks at start-up read the checkpoint's config and headers.
    with pytest.raises(ValueError, match="reward.model.hf_path: .*config.json has archi"):
        c.reward.model.hf_path = str(tmp_path)
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
        options.from_config(c)
    c.reward.model.hf_path = str(rm_dir[0])
    assert options.from_config(c).reward.model.hf_path == str(rm_dir[0])
    assert json.dumps(options.as_dict(c))  # stays plain data for the checkpoint


@pytest.mark.slow
def test_loop_weighs_the_reward_model_in(tmp_path, rm_dir):
    """The default config's GRPO loop with spec "synthetic:1.0,rm:0.5": the model term is
    scored every step (the prompts' messages reach it through the text task), and the step's
    mean reward is the terms' means weighted."""
    path, _ = rm_dir
    if "llama" in str(path):
        pytest.skip("one family end to end is enough")
    from lrl import loop
    from tests.test_loop import tiny_config
    c = tiny_config()
    c.sft.steps = 0
    c.rl.steps = 2
    c.eval.every = 0
    c.reward.spec = "synthetic:1.0,rm:0.5"
    c.reward.model.update(hf_path=str(path), max_len=256, batch_rows=4, dtype="float32")
    loop.run(c, str(tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    grpo = [r for r in rows if r["phase"] == "grpo" and "reward/mean" in r]
    assert len(grpo) == 2
    for r in grpo:
        assert r["reward/rm_rows"] >= 1 and r["reward/n_error"] == 0
        assert r["reward/term_mean/rm"] != 0
        assert r["reward/mean"] == pytest.approx(
            r["reward/term_mean/synthetic"] + 0.5 * r["reward/term_mean/rm"], abs=1e-5)


@pytest.mark.slow
def test_multi_turn_loop_adds_the_reward_model_to_the_environments_reward(tmp_path, rm_dir):
    """`configs/default.py:tools_runlocal` with spec "synthetic:1.0,rm:0.5": the environment
    scores the final answer with the rule term in the pool's workers, the reward model the
    whole conversation on the mesh; a trajectory's reward is the sum."""
    import os
    from lrl import config_util, loop
    path, _ = rm_dir
    if "llama" in str(path):
        pytest.skip("one family end to end is enough")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = config_util.load(os.path.join(root, "configs", "default.py"), "tools_runlocal")
    c.mesh.update(fsdp=4, tensor=2)   # the suite's 8 devices
    c.sft.steps = 0
    c.rl.steps = 1
    c.eval.every = 0
    c.reward.spec = "synthetic:1.0,rm:0.5"
    c.reward.model.update(hf_path=str(path), max_len=256, batch_rows=4, dtype="float32")
    m = loop.run(c, str(tmp_path / "run"))["grpo"]
    assert m["rollout/env_trajectories"] == 16 and m["reward/rm_rows"] >= 1
    assert m["reward/term_mean/rm"] != 0 and np.isfinite(m["loss"])
    assert m["reward/mean"] == pytest.approx(
        m["turns/env_reward_mean"] + 0.5 * m["reward/term_mean/rm"], abs=1e-5)


def _rm_config(path, **rm):
    from tests.test_loop import tiny_config
    c = tiny_config()
    c.reward.spec = "synthetic:1.0,rm:0.5"
    c.reward.model.update(**{**dict(hf_path=str(path), max_len=256, batch_rows=4,
                                    dtype="float32"), **rm})
    return c


def test_preflight_checks_the_reward_model(tmp_path, rm_dir):
    """The start-up check reads the reward model's headers and tokenizer and the mesh's
    divisibility: each fault is a UserError naming the file or config key."""
    import shutil
    from lrl import mesh as mesh_lib
    from lrl import preflight
    from lrl.errors import UserError
    path, _ = rm_dir
    mesh = mesh_lib.make_mesh({"fsdp": 4, "tensor": 2})
    times = preflight.run(preflight.options(_rm_config(path)), str(tmp_path / "w"), mesh)
    assert "reward_model" in times
    with pytest.raises(UserError, match=r"batch_rows=6 does not divide.*reward.model.batch_rows"):
        preflight.run(preflight.options(_rm_config(path, batch_rows=6)), str(tmp_path / "w"),
                      mesh)
    bad = tmp_path / "no_template"
    shutil.copytree(path, bad)
    cfg_json = json.loads((bad / "tokenizer_config.json").read_text())
    cfg_json.pop("chat_template", None)
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg_json))
    for t in bad.glob("chat_template.*"):
        t.unlink()
    with pytest.raises(UserError, match="no chat template.*reward.model.hf_path="):
        preflight.run(preflight.options(_rm_config(bad)), str(tmp_path / "w"), mesh)
    wide = tmp_path / "wide"
    shutil.copytree(path, wide)
    hf = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**hf, "intermediate_size": 64}))
    with pytest.raises(UserError, match="do not have the shape.*config.json"):
        preflight.run(preflight.options(_rm_config(wide)), str(tmp_path / "w"), mesh)
