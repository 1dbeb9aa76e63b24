"""docs/own-model-and-data.md (README's "My own model and data?"): configs/qwen2_5_math.py's
command on a local Hugging Face checkpoint, a local tokenizer and jsonl files, nothing
downloaded (shrunk to seconds)."""
import json
import os

import numpy as np
import pytest

from lrl import config_util, loop

torch = pytest.importorskip("torch")  # transformers writes the checkpoint, as a user's was

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_qwen2_5_math_config_runs_on_a_local_checkpoint_and_jsonl(tmp_path):
    from lrl.data.synthetic import synthetic_corpus
    from lrl.data.tokenizer import build_tokenizer
    import transformers
    tok = build_tokenizer(synthetic_corpus(200), 300, out_dir=str(tmp_path / "tok"))
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id)).save_pretrained(str(tmp_path / "hf"))
    rng = np.random.default_rng(0)
    for name, n in (("train", 16), ("test", 4)):      # the MATH-style fields the config reads
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for a, b in rng.integers(0, 5, (n, 2)):
                f.write(json.dumps({"problem": f"Compute {a} + {b}.", "answer": str(a + b)}) + "\n")
    c = config_util.load(os.path.join(ROOT, "configs", "qwen2_5_math.py"), "1.5b")
    # The docstring's command's paths ...
    c.model.hf_path, c.tokenizer.path = str(tmp_path / "hf"), str(tmp_path / "tok")
    c.data.paths, c.data.eval_paths = str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl")
    # ... and sizes for a CPU.
    c.model.dtype = "float32"
    c.mesh.update(fsdp=4, tensor=2)  # the suite's 8 virtual devices
    c.data.max_prompt_len = 96
    c.rl.update(steps=1, prompts_per_step=4, group_size=2, max_new_tokens=8, row_len=128,
                max_tokens_per_micro=256, overlong_buffer=2, minibatches=1, max_resample=0)
    c.optim.warmup_steps = 1
    c.eval.update(every=1, num_prompts=4, k=2)
    c.reward.num_workers = 0
    c.metrics.tensorboard = False
    out = loop.run(c, str(tmp_path / "run"))
    assert out["grpo"]["response/length_mean"] > 0 and "eval/reward/mean" in out["grpo"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # the held-out baseline, then the step
