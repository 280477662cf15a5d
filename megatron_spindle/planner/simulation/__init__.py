"""The step simulator: a plan's step time, wave by wave, on the cluster's links.

``simulate`` (the step: compute from the curves, inter-wave transfers, gradient sync, optimizer, memory),
``timeline`` (each device's clock through the waves of every pass), ``link_costs`` (the point-to-point and
ring formulas), ``grad_buckets`` (DDP's gradient buckets and when each is reduced).
"""
