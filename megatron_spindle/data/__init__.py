"""Real training data for Spindle plans.

* :mod:`.sharding` (pure Python): which samples of each task's global batch every rank must read, from the
  plan's data-parallel layout of the slices that read data streams;
* :mod:`.energon` (torch + megatron-energon): one energon dataset per task, read so that each rank gets only
  those samples.
"""
