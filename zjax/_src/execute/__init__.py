"""Execute: a schedule as one shard_map program (gathers, recompute, reduce-scatters)."""
