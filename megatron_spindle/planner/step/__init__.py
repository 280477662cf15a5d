"""Stage 3, the whole step: from level schedules to the plan the runtime executes, and its cost.

Levels assembled into one step and their bounds tightened (``assemble``), the whole-step choice among
candidates (``choose``, ``backfill``), placement on devices and islands (``placement``), the data flow
between waves (``dataflow``), the plan itself and its checks (``plan``, ``validate``, ``render``), the step
simulator (``simulate``, ``link_costs``), the baselines in the same plan format (``baselines``), and the
entry points (``build``: ``make_plan``, ``plan_system``; ``manual``: hand-written plans for tests).
"""
