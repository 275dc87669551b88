"""Trace: the loss function as numbered ops, its loops, rolled runs and segments."""
