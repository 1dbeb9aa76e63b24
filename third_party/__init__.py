"""Thin adapters to outside frameworks. The core (`lrl/`) never imports this package."""
