"""Stage 3, assembly: from level schedules to the plan the runtime executes.

Levels assembled into one step and their bounds tightened (``assemble``), placement on devices and islands
(``placement``, its search state ``placement_state``), the data flow between waves (``dataflow``: the one owner
of slice layouts, edges, messages and parameter groups, stored in the plan), how a plan runs (``execution``:
passes, recompute, phases, the distributed optimizer, TP), the plan itself, its checks and drawings (``plan``,
``validate``, ``render``), and hand-written plans for tests (``manual``).
"""
