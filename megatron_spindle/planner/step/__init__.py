"""Stage 6, the whole step: which plan trains a step fastest, judged by the simulator.

The whole-step choice among candidates (``choose``): the level-by-level waves, backfilled and cross-level waves
(``backfill``), task lanes (``lanes``), the step search's local moves (``step_search``) and the baselines'
schedules; and the entry points (``build``: ``make_plan``, ``plan_system``).
"""
