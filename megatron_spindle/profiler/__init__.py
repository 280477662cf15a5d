"""Measuring MetaOps on the live backend and fitting their scaling curves (``spindle profile``).

* :mod:`.points`: what is measured (targets, points, rounds) and the cache of measured points; pure Python;
* :mod:`.fit`: measured points -> fitted curves -> the curves file ``spindle plan/compare --curves`` read; pure;
* :mod:`.link`: the backend's latency and bandwidth in the simulator's cost model;
* :mod:`.timing`: one layer's forward + backward, built and run as the wave runtime does (torch);
* :mod:`.run`: the multi-process profile itself and its launching; :mod:`.cli`: the ``spindle profile`` command.
"""
