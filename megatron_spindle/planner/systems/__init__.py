"""Every system in Spindle's plan format, and each at its own best configuration.

The baselines' schedules (``baselines``: sequential, task-level, intra-task; ``static_grids``: megatron.core
MIMO-style module grids; ``module_blocks``: Spindle's whole-step candidate of one device block per module),
the device-share searches they share (``shares``), and the tuners (``tuning`` for the baselines and the
static grids, ``tune_spindle`` for Spindle).
"""
