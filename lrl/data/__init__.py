"""Data for lrl: a locally trained tokenizer with a chat template (`tokenizer`), synthetic
verifiable tasks (`synthetic`), grain sources for jsonl/parquet/synthetic data (`sources`),
the prompt pipeline with length filtering, sharding, token balancing and a checkpointable
iterator (`prompts`), and packing of variable-length sequences into fixed rows (`packing`).

Submodules are imported explicitly (``from lrl.data import packing``) so that importing one
does not pull in grain or transformers when it does not need them.
"""
