"""Where megatron_spindle meets what differs between versions and machines.

* :mod:`.mcore` - the differences between the supported megatron-core lines (0.16.1 on Python 3.11,
  0.19.x on Python 3.12), detected by feature, not by version number;
* :mod:`.megatron_lm` - CPU stand-ins for Megatron-LM's CUDA-only start-up (applied only without CUDA).
"""
