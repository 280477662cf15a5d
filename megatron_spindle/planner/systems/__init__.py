"""Stage 5, every system in Spindle's plan format.

The baselines' schedules (``baselines``: sequential, task-level, intra-task; ``static_grids``: megatron.core
MIMO-style module grids; ``module_blocks``: Spindle's whole-step candidate of one device block per module),
the device-share searches they share (``shares``), and the whole-step bound of a configuration (``bounds``).
"""
