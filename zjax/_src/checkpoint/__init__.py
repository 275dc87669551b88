"""Checkpoint: orbax sharded checkpoints, restore into another layout, preemption."""
