"""The score model (critic / reward model) against transformers' *ForSequenceClassification and
*ForTokenClassification: per-token scores, packed rows, sharded meshes, and the HF export."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from lrl import mesh as mesh_lib
from lrl.models import score as score_lib
from lrl.models.decoder import default_positions
from tests.hf_util import FAMILIES

_CLASSES = {("llama", "seq"): "LlamaForSequenceClassification",
            ("llama", "tok"): "LlamaForTokenClassification",
            ("qwen2", "seq"): "Qwen2ForSequenceClassification",
            ("qwen2", "tok"): "Qwen2ForTokenClassification",
            ("qwen3", "seq"): "Qwen3ForSequenceClassification"}


def make_score_model(family, kind, path, num_labels=1, seed=0):
    """A random HF classification model saved to `path`; returns the fp32 torch model."""
    torch.manual_seed(seed)
    hf_cfg = FAMILIES[family](num_labels=num_labels, pad_token_id=0)
    model = getattr(transformers, _CLASSES[family, kind])(hf_cfg).float().eval()
    with torch.no_grad():  # biases and norms start at 0 / 1; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long)
                     ).logits.float().numpy()


def _batch(tokens, segment_ids=None):
    tokens = np.asarray(tokens, np.int32)
    seg = np.ones_like(tokens) if segment_ids is None else np.asarray(segment_ids, np.int32)
    return {"tokens": tokens, "segment_ids": seg,
            "positions": np.asarray(default_positions(jnp.asarray(tokens), jnp.asarray(seg)))}


@pytest.fixture(scope="module", params=[("qwen2", "tok", 1), ("llama", "tok", 3),
                                        ("qwen2", "seq", 1), ("llama", "seq", 2),
                                        ("qwen3", "seq", 1)])
def model_dir(request, tmp_path_factory):
    family, kind, labels = request.param
    path = tmp_path_factory.mktemp(f"{family}_{kind}")
    return family, kind, labels, path, make_score_model(family, kind, path, labels)


def test_scores_match_transformers(model_dir):
    family, kind, labels, path, torch_model = model_dir
    cfg, params, head, meta = score_lib.load_hf_score(str(path))
    assert cfg.model_type == family and head.shape == (cfg.d_model, labels)
    assert meta["num_labels"] == labels and meta["pad_token_id"] == 0
    assert meta["kind"].endswith("TokenClassification" if kind == "tok" else
                                 "SequenceClassification")
    assert (meta["bias_L"] is not None) == (kind == "tok")
    assert "lm_head" not in params
    # No pad id (0) inside, so transformers' sequence classifier reads the last token.
    tokens = np.random.RandomState(0).randint(1, cfg.vocab_size, size=(2, 24))
    ours = np.asarray(score_lib.token_scores(cfg, params, head, _batch(tokens),
                                             bias_L=meta["bias_L"]))
    assert ours.shape == (2, 24, labels) and ours.dtype == np.float32
    want = torch_logits(torch_model, tokens)
    got = ours if kind == "tok" else ours[:, -1]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_packed_rows_equal_sequences_alone(model_dir):
    family, kind, labels, path, torch_model = model_dir
    cfg, params, head, meta = score_lib.load_hf_score(str(path))
    rng = np.random.RandomState(1)
    lengths = [7, 13, 5]
    seqs = [rng.randint(1, cfg.vocab_size, size=n) for n in lengths]
    T = 32
    pad = T - sum(lengths)
    tokens = np.concatenate(seqs + [np.zeros(pad, int)])[None]
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad, int)])
    ours = np.asarray(score_lib.token_scores(cfg, params, head, _batch(tokens, seg[None]),
                                             bias_L=meta["bias_L"]))[0]
    start = 0
    for s in seqs:
        want = torch_logits(torch_model, s[None])[0]
        got = ours[start:start + len(s)] if kind == "tok" else ours[start + len(s) - 1]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        start += len(s)


@pytest.mark.parametrize("attention,sizes", [("dense", {"fsdp": 4, "seq": 2}),
                                             ("ring", {"fsdp": 2, "seq": 4}),
                                             ("ulysses", {"fsdp": 4, "seq": 2})])
def test_sharded_equals_unsharded(tmp_path_factory, attention, sizes):
    path = tmp_path_factory.mktemp("sharded")
    make_score_model("qwen2", "tok", path, num_labels=1, seed=3)
    cfg, params, head, meta = score_lib.load_hf_score(str(path))
    rng = np.random.RandomState(2)
    tokens = rng.randint(1, cfg.vocab_size, size=(4, 32))
    # Segments that do not align with the seq shards' boundaries, and a padded tail.
    seg = np.stack([np.concatenate([np.full(11, 1), np.full(18, 2), np.zeros(3, int)])] * 2
                   + [np.ones(32, int)] * 2)
    batch = _batch(tokens, seg)
    want = np.asarray(score_lib.token_scores(cfg, params, head, batch, bias_L=meta["bias_L"]))
    mesh = mesh_lib.make_mesh(sizes)
    cfg_m, params_m, head_m, _ = score_lib.load_hf_score(str(path), mesh=mesh,
                                                         attention=attention)
    assert head_m.sharding == score_lib.head_sharding(cfg_m, mesh, 1)
    assert params_m["embed"]["embedding"].sharding.spec == \
        score_lib.score_param_shardings(cfg_m, mesh)["embed"]["embedding"].spec
    fn = jax.jit(lambda p, h, b: score_lib.token_scores(cfg_m, p, h, b, mesh,
                                                        bias_L=meta["bias_L"]))
    got = np.asarray(fn(params_m, head_m, mesh_lib.put_batch(mesh, batch)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,with_bias", [("qwen2", False), ("llama", True)])
def test_save_token_classification_loads_in_transformers(tmp_path, family, with_bias):
    src = tmp_path / "src"
    make_score_model(family, "seq", src, num_labels=2, seed=4)
    cfg, params, head, _ = score_lib.load_hf_score(str(src))
    bias = np.array([0.5, -0.25], np.float32) if with_bias else None
    out = tmp_path / "out"
    score_lib.save_hf_token_classification(cfg, params, head, str(out), bias_L=bias)
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == [f"{ {'qwen2': 'Qwen2', 'llama': 'Llama'}[family]}"
                                   "ForTokenClassification"]
    loaded = transformers.AutoModelForTokenClassification.from_pretrained(str(out)).float().eval()
    assert loaded.config.num_labels == 2
    tokens = np.random.RandomState(5).randint(1, cfg.vocab_size, size=(2, 20))
    want = np.asarray(score_lib.token_scores(cfg, params, head, _batch(tokens), bias_L=bias))
    np.testing.assert_allclose(torch_logits(loaded, tokens), want, atol=1e-4, rtol=1e-4)
    # ... and lrl reads its own export back.
    cfg2, params2, head2, meta2 = score_lib.load_hf_score(str(out))
    assert meta2["kind"] == "ForTokenClassification" and meta2["num_labels"] == 2
    again = score_lib.token_scores(cfg2, params2, head2, _batch(tokens), bias_L=meta2["bias_L"])
    np.testing.assert_allclose(np.asarray(again), want, atol=1e-6)


def test_policy_params_become_a_critic():
    """The critic starts from the policy's decoder (lm_head dropped) and a fresh head, and its
    hidden states are the policy's."""
    from lrl import models
    cfg = models.tiny_config(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                             mlp_dim=48, tie_embeddings=False)
    params = models.init_params(cfg, jax.random.key(0))
    critic = score_lib.decoder_params(params)
    assert set(params) - set(critic) == {"lm_head"}
    head = score_lib.init_head(cfg, jax.random.key(1), num_labels=1)
    tokens = np.random.RandomState(6).randint(0, 64, size=(2, 16))
    got = score_lib.token_scores(cfg, critic, head, _batch(tokens))
    x = models.hidden_states(cfg, params, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ head), atol=1e-5)


def test_not_a_classifier_is_a_clear_error(tmp_path):
    from tests.hf_util import make_hf_model
    make_hf_model("qwen2", tmp_path / "lm")
    with pytest.raises(ValueError, match=r"config.json.*ForCausalLM.*not a \*ForSequenceClass"):
        score_lib.load_hf_score(str(tmp_path / "lm"))
    src = tmp_path / "rm"
    make_score_model("qwen2", "seq", src)
    hf = json.loads((src / "config.json").read_text())
    hf["id2label"] = {"0": "a", "1": "b", "2": "c"}
    (src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"score.weight has shape \[1, 64\].*num_labels=3"):
        score_lib.load_hf_score(str(src))
