"""Tiny random Hugging Face models built locally, the reference that lrl is checked against."""
import torch
import transformers

FAMILIES = {
    # Llama 3.1-style RoPE scaling, GQA ratio 4.
    "llama": lambda **kw: transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
        initializer_range=0.1, tie_word_embeddings=False, **kw),
    # Qwen2.5-style: q/k/v biases, tied embeddings, GQA ratio 1.
    "qwen2": lambda **kw: transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rope_theta=1e6, rms_norm_eps=1e-6,
        initializer_range=0.1, tie_word_embeddings=True, **kw),
    # Qwen3: q/k RMSNorm, head_dim not equal to width / heads, GQA ratio 2.
    "qwen3": lambda **kw: transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
        initializer_range=0.1, tie_word_embeddings=False, **kw),
}


def make_hf_model(family: str, path, seed: int = 0, max_shard_size=None, **kw):
    """Builds a random HF model, saves it to `path` and returns the fp32 torch model."""
    torch.manual_seed(seed)
    hf_cfg = FAMILIES[family](**kw)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[family]
    model = cls(hf_cfg).float().eval()
    with torch.no_grad():  # biases start at zero; make them count in the comparison
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return model


def hf_logits(model, tokens, position_ids=None):
    with torch.no_grad():
        t = torch.as_tensor(tokens, dtype=torch.long)
        kw = {} if position_ids is None else {"position_ids": torch.as_tensor(position_ids)}
        return model(input_ids=t, **kw).logits.float().numpy()


def rel_err(a, b):
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
