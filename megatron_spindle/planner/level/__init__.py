"""Stage 2, one MetaLevel's schedule: how a level's MetaOps share the devices over time.

The relaxed optimum ``C*`` and bi-point discretization (``allocate``), Algorithm 1's waves (``waves``), the
candidate search around it (``scheduler``), layers moved between waves (``polish``), throughput waves
(``knapsack``), annealing and ruin-and-recreate (``anneal``), and the lower bounds and exact searches that
certify a level: the area model (``area``), the configuration LP over wave patterns and its dives
(``patterns``), the near-optimal cover (``near_optimal``) and the wave MILP (``solver``).
"""
