"""Stage 7, every system at its own best configuration: ``tune`` for the baselines and the static grids,
``tune_spindle`` for Spindle (passes, recompute, phases, the distributed optimizer, TP)."""
