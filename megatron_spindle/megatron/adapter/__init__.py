"""Megatron-LM's side of a run, shared by both loops: flags, hooks, model chunk, schedule, model, data."""
