"""The planner: pure Python + numpy (HiGHS optional), in stages that import one way (each only earlier ones).

1. :mod:`.workload`: the task graph and model specs, operator costs and memory, the cluster, the contraction
   into MetaOps and their scaling curves;
2. :mod:`.level`: one MetaLevel's schedule (allocation, Algorithm 1, the searches and the bounds);
3. :mod:`.assembly`: levels assembled into a plan: placement, the data flow between waves, how the plan runs
   (passes, recompute, phases, ZeRO-1, TP), the plan itself, its validation and drawings;
4. :mod:`.simulation`: the step simulator (per-device timeline, link costs, gradient buckets) and the bounds on
   the whole step;
5. :mod:`.systems`: the baselines' schedules (sequential, task-level, intra-task, static grids, module blocks);
6. :mod:`.step`: the whole-step choice among Spindle's candidates and the baselines' schedules, and the entry
   points ``make_plan`` and ``plan_system`` (:mod:`.step.build`);
7. :mod:`.tuning`: every system, Spindle included, at its own best configuration.

Shared by every stage: :mod:`.exact` (machine-independent arithmetic), :mod:`.limits` (input caps),
:mod:`.jsonfile`. Callers import a name from the module that defines it (``tests/test_import_rules.py`` holds
the stage order).
"""
