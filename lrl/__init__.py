"""lrl: reinforcement learning for language models on very long sequences, in JAX."""
