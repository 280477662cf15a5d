"""Checkpoints: megatron.core distributed checkpointing (``save_load``), files and manifest (``files``), the
save directory's torch-free checks and lock (``directory``)."""
