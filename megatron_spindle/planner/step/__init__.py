"""Stage 3, the whole step: from level schedules to the plan the runtime executes.

Levels assembled into one step and their bounds tightened (``assemble``), the whole-step choice among
candidates (``choose``, ``backfill``), placement on devices and islands (``placement``, ``placement_state``),
the data flow between waves (``dataflow``), how a plan runs (``execution``: passes, recompute, phases, the
distributed optimizer, TP), the plan itself, its checks and drawings (``plan``, ``validate``, ``render``), and
the entry points (``build``: ``make_plan``, ``plan_system``; ``manual``: hand-written plans for tests). A
step's cost is :mod:`..simulation`'s; the baselines and the tuners are :mod:`..systems`.
"""
