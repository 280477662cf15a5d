"""Megatron's multi-modal models (``megatron.core.models.mimo``) as Spindle workloads, the pure-Python half.

A user's model provider returns a ``MimoModel``; the torch side (:mod:`megatron_spindle.models.mimo_extract`)
describes it (:mod:`.describe`), and :mod:`.graph` turns the description and the tasks (:mod:`.tasks`) into the
planner's task graph. :mod:`.workload` is what ``spindle plan|compare`` and the tuner take. docs/mimo.md.
"""
