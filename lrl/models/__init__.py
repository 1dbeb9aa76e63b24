"""lrl.models: the Llama / Qwen2 / Qwen3 decoder, its parameters and HF checkpoint I/O.

    cfg, params = lrl.models.load_hf(path, dtype=jnp.float32)
    logits_BTV = lrl.models.forward(cfg, params, tokens_BT, positions_BT=None,
                                    segment_ids_BT=None, mesh=None)
"""
from lrl.models.config import ModelConfig, RopeScaling, from_hf_dict, from_hf_dir, tiny_config
from lrl.models.decoder import Block, Decoder
from lrl.models.forward import batch_hidden_states, forward, hidden_states, unembedding
from lrl.models.hf_io import load_hf, save_hf, to_hf_state
from lrl.models.params import abstract_params, init_params, logical_axes, param_shardings

__all__ = ["ModelConfig", "RopeScaling", "from_hf_dict", "from_hf_dir", "tiny_config", "Block",
           "Decoder", "batch_hidden_states", "forward", "hidden_states", "unembedding", "load_hf", "save_hf",
           "to_hf_state", "abstract_params", "init_params", "logical_axes", "param_shardings"]
