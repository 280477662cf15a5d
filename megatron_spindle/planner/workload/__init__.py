"""Stage 1, the workload model: what is trained and on what.

The task graph and model specs (``graph``, ``spec``, ``spec_layers``, ``layer_types``, ``workloads``), the
cost of each operator (``costs``: FLOPs, parameters, activations; ``memory``: bytes per device), the cluster
(``cluster``), the contraction of operators into MetaOps and their levels (``metaops``), and each MetaOp's
scaling curve, fitted from profiled points or from the analytic device model (``curves``, ``analytic``).
"""
