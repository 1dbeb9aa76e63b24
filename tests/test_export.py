"""`python -m lrl.export`: a training checkpoint -> HF safetensors / PyTorch that transformers
loads with the same logits as lrl's forward on the checkpoint's parameters."""
import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import lrl.models as models
from lrl import checkpoint as ck
from lrl import export
from tests.hf_util import hf_logits, make_hf_model, rel_err

class TrainState(NamedTuple):  # as lrl.rl.update.TrainState
    step: jax.Array
    params: dict
    opt_state: tuple


TOKENS = np.random.RandomState(0).randint(0, 128, size=(2, 24))


def _save_run(family, tmp, with_model_config=True, tokenizer=None, steps=(3, 5)):
    """A checkpoint as the loop writes it: params of a tiny HF model inside a train state."""
    make_hf_model(family, tmp / "hf")
    cfg, params = models.load_hf(str(tmp / "hf"))
    state = TrainState(jnp.int32(0), params, optax.adamw(1e-3).init(params))
    with ck.CheckpointManager(tmp / "ckpt", keep=3) as mgr:
        for s in steps:
            if s != steps[-1]:  # an older step with other weights: export must take the newest
                old = state._replace(params=jax.tree.map(lambda x: x * 0.5, params))
                mgr.save(s, old, model_config=cfg if with_model_config else None)
            else:
                mgr.save(s, state, model_config=cfg if with_model_config else None)
        if tokenizer is not None:
            mgr.save_tokenizer(tokenizer)
    return cfg, params


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.optimized
def test_fp32_export_matches_lrl_forward(family, tmp_path):
    cfg, params = _save_run(family, tmp_path)
    out = tmp_path / "out"
    report = export.export(str(tmp_path / "ckpt"), str(out))
    assert report["step"] == 5 and report["dtype"] == "float32"
    assert report["max_rel_err"] is not None and report["max_rel_err"] <= 1e-5
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(os.listdir(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    want = np.asarray(models.forward(cfg, params, TOKENS))
    assert rel_err(hf_logits(hf, TOKENS), want) < 1e-4
    gen = json.loads((out / "generation_config.json").read_text())
    eos = list(cfg.eos_token_ids)
    assert gen["eos_token_id"] == (eos[0] if len(eos) == 1 else eos or None)
    assert not [p for p in os.listdir(tmp_path) if "tmp-export" in p or "old-export" in p]


def test_bf16_sharded_export_loads(tmp_path):
    cfg, params = _save_run("qwen3", tmp_path)
    out = tmp_path / "out16"
    report = export.main(["--checkpoint", str(tmp_path / "ckpt"), f"--output={out}",
                          "--dtype=bfloat16", "--max_shard_bytes=60000"])
    assert report == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert next(hf.parameters()).dtype == torch.bfloat16
    want = np.asarray(models.forward(cfg, params, TOKENS))
    assert rel_err(hf_logits(hf.float().eval(), TOKENS), want) < 5e-2


def test_torch_state_dict_loads_strict(tmp_path):
    cfg, params = _save_run("qwen2", tmp_path)  # tied embeddings
    out = tmp_path / "out"
    assert export.main([f"--checkpoint={tmp_path / 'ckpt' / '5'}", f"--output={out}",
                        "--format=torch"]) == 0
    sd = torch.load(out / "pytorch_model.bin", weights_only=True)
    hf_cfg = transformers.AutoConfig.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    model.load_state_dict(sd, strict=True)
    want = np.asarray(models.forward(cfg, params, TOKENS))
    assert rel_err(hf_logits(model, TOKENS), want) < 1e-4


def test_older_step_tokenizer_and_overwrite(tmp_path):
    from tokenizers import Tokenizer, models as tok_models
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "a", "b", "c"])}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, unk_token="a")),
        bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    cfg, params = _save_run("llama", tmp_path, tokenizer=tok)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export.export(str(tmp_path / "ckpt"), str(out), step=3)
    assert (out / "stale.txt").exists()
    os.rename(tmp_path / "ckpt", tmp_path / "checkpoints")  # the loop's workdir layout
    report = export.export(str(tmp_path), str(out), step=3, overwrite=True)
    assert report["step"] == 3 and not (out / "stale.txt").exists()
    assert "tokenizer.json" in report["files"]
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    assert back.convert_tokens_to_ids("b") == 4 and back.eos_token_id == 2
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["pad_token_id"] == 0 and gen["bos_token_id"] == cfg.bos_token_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    half = jax.tree.map(lambda x: x * 0.5, params)  # step 3 stored halved weights
    assert rel_err(hf_logits(hf, TOKENS), np.asarray(models.forward(cfg, half, TOKENS))) < 1e-4


def test_a_skipped_newer_step_is_named_in_the_last_line(tmp_path, capsys):
    _save_run("qwen3", tmp_path)
    for root, _, files in os.walk(tmp_path / "ckpt" / "5" / "state"):  # step 5's data garbled
        for f in files:
            if os.path.basename(root) == "d":
                path = os.path.join(root, f)
                b = bytearray(open(path, "rb").read())
                b[len(b) // 2:len(b) // 2 + 8] = bytes(x ^ 0xFF for x in b[len(b) // 2:][:8])
                open(path, "wb").write(bytes(b))
    assert export.main([f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'o'}"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("exported step 3 ")
    reason = last.split("; skipped newer step 5 (unreadable: ", 1)[1]
    assert "5/state" in reason  # what the restore found wrong with it


def test_bad_inputs_name_the_culprit(tmp_path, capsys):
    _save_run("qwen3", tmp_path, with_model_config=False, steps=(1,))
    with pytest.raises(ValueError, match="no model_config"):
        export.export(str(tmp_path / "ckpt"), str(tmp_path / "o"))
    with pytest.raises(ck.CheckpointError, match="step 9"):
        export.export(str(tmp_path / "ckpt"), str(tmp_path / "o"), step=9)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        export.export(str(tmp_path / "nowhere"), str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("keep me")
    assert export.main([f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'o'}"]) == 1
    assert "not empty; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "o" / "x").read_text() == "keep me"
