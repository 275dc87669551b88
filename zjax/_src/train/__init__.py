"""Optimize: the zero3 trainer (optax on the shards), its optimizer probe and offload."""
