"""`python -m lrl.export --role=critic`: PPO's critic in a checkpoint -> a HF
*ForTokenClassification that transformers loads with the critic's values as its logits."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
import transformers

import lrl.models as models
from lrl import checkpoint as ck
from lrl import export, export_critic
from lrl.models import score as score_lib
from lrl.rl.train import TrainState
from tests.hf_util import make_hf_model

TOKENS = np.random.RandomState(0).randint(0, 128, size=(2, 24)).astype(np.int32)


def _values(cfg, decoder, head):
    batch = {"tokens": TOKENS, "segment_ids": np.ones_like(TOKENS),
             "positions": np.broadcast_to(np.arange(24, dtype=np.int32), TOKENS.shape)}
    return np.asarray(score_lib.token_scores(cfg, decoder, head, batch))


def _critic(family, tmp):
    make_hf_model(family, tmp / "hf")
    cfg, params = models.load_hf(str(tmp / "hf"))
    decoder = score_lib.decoder_params(jax.tree.map(lambda x: x * 1.01, params))
    head = score_lib.init_head(cfg, jax.random.key(3), 1, stddev=0.5)
    return cfg, params, decoder, head


def _save_ppo_run(family, tmp, steps=(2, 4)):
    """A checkpoint as a PPO run writes it: the policy's state, and the critic's TrainState as
    the step's `critic` item ({"decoder", "score_DL"} params and their optimizer state)."""
    cfg, params, decoder, head = _critic(family, tmp)
    state = TrainState(jnp.int32(0), params, optax.adamw(1e-3).init(params))
    critic_params = {"decoder": decoder, "score_DL": head}
    with ck.CheckpointManager(tmp / "ckpt", keep=3) as mgr:
        for s in steps:
            mgr.save(s, state, model_config=cfg)
    for s in steps:   # the older step's critic has other weights: the newest must be taken
        p = critic_params if s == steps[-1] else jax.tree.map(lambda x: x * 0.5, critic_params)
        critic = TrainState(jnp.int32(s), p, optax.adamw(1e-3).init(p))
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(
            tmp / "ckpt" / str(s) / "critic", args=ocp.args.PyTreeSave(critic))
    return cfg, decoder, head


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_critic_checkpoint_exports_to_transformers(family, tmp_path):
    cfg, decoder, head = _save_ppo_run(family, tmp_path)
    out = tmp_path / "critic"
    assert export.main([f"--checkpoint={tmp_path / 'ckpt'}", f"--output={out}",
                        "--role=critic"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"][0].endswith("ForTokenClassification")
    model = transformers.AutoModelForTokenClassification.from_pretrained(str(out)).float().eval()
    assert model.config.num_labels == 1 and model.score.bias is None
    with torch.no_grad():
        got = model(input_ids=torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()
    want = _values(cfg, decoder, head)
    assert np.abs(want).max() > 0.1   # a head of non-trivial values
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_export_critic_from_arrays_bf16_and_sharded(tmp_path):
    cfg, _, decoder, head = _critic("qwen3", tmp_path)
    out = tmp_path / "out"
    report = export_critic.export_critic(cfg, decoder, head, str(out), dtype="bfloat16",
                                         max_shard_bytes=60000)
    assert report["num_labels"] == 1 and report["max_rel_err"] <= 5e-2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = transformers.AutoModelForTokenClassification.from_pretrained(
        str(out), dtype=torch.bfloat16).float().eval()
    with torch.no_grad():
        got = model(input_ids=torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()
    want = _values(cfg, decoder, head)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 5e-2
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_critic.export_critic(cfg, decoder, head, str(out))


def test_no_critic_is_a_clear_error(tmp_path, capsys):
    make_hf_model("qwen2", tmp_path / "hf")
    cfg, params = models.load_hf(str(tmp_path / "hf"))
    with ck.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, TrainState(jnp.int32(0), params, ()), model_config=cfg)
    assert export.main([f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'o'}",
                        "--role=critic"]) == 1
    err = capsys.readouterr().err
    assert "saved a 'critic' item" in err and "PPO" in err
    assert not os.path.exists(tmp_path / "o")
