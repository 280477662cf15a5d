"""megatron.core's ``DistributedDataParallel`` as :mod:`.grad_sync` uses it: its configuration (sum, no
averaging), the module it wraps, the no-op that hands the posting of reduces to the plan, and its backward
hooks on the parameters' gradient accumulators, found and removed on release.

**Hooks.** megatron.core's DDP registers one hook per parameter on the parameter's ``AccumulateGrad`` node
(``grad_acc.register_hook(self._make_backward_post_hook(param))``, megatron-core 0.16 to 0.19) and keeps no
handle. The node outlives the DDP: a leaf's node is cached while anything holds it, and a later DDP over the
same parameters (the model a task-mix change builds, :mod:`.replan`) registers on that same node. Each hook's
closure holds its DDP, so without removal every replan would keep the old DDP alive, with its fp32 gradient
buffer for every weight the new model reuses. :func:`backward_hooks` finds a DDP's hooks in the nodes' hook
dictionaries (reached through the handle of a hook registered and removed at once); :func:`remove` drops them.
"""
from __future__ import annotations

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ..models.blocks import no_cuda_graph_scope


def driven_by_the_plan(force_all_reduce: bool = False) -> None:
    """Replaces a bucket group's ``start_grad_sync``: megatron calls it when the bucket is ready on this rank
    (and from ``finish_grad_sync``); the reduce is posted by :mod:`.grad_sync` at its place in the global
    order instead."""


class Params(nn.Module):
    """The parameters of one rank set, in a fixed order (the module megatron's DDP wraps)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


def ddp_config_for(*, overlap: bool, bucket_size: int | None, grad_reduce_in_fp32: bool = False,
                   distributed_optimizer: bool = False) -> DistributedDataParallelConfig:
    """Sum (no averaging) in the parameters' dtype, buckets posted as they fill when ``overlap``;
    reduce-scatter and parameter all-gather with ``distributed_optimizer``."""
    return DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=bucket_size,
                                         grad_reduce_in_fp32=grad_reduce_in_fp32, average_in_collective=False,
                                         use_distributed_optimizer=distributed_optimizer)


def sum_config() -> TransformerConfig:
    """The model config DDP reads: only ``calculate_per_token_loss`` matters (sum, no 1/dp scaling)."""
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, calculate_per_token_loss=True,
                             use_cpu_initialization=True, **no_cuda_graph_scope())


def _noop(*_args) -> None:
    return None


def _holds(fn, obj) -> bool:
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            if cell.cell_contents is obj:
                return True
        except ValueError:  # an empty cell
            continue
    return False


def backward_hooks(ddp) -> list[tuple[dict, int]]:
    """``[(hook dictionary of a gradient accumulator, key)]`` of every hook whose closure holds ``ddp``."""
    found = []
    for acc in getattr(ddp, "grad_accs", ()):
        handle = acc.register_hook(_noop)
        hooks = handle.hooks_dict_ref()
        handle.remove()
        if hooks is None:
            continue
        found += [(hooks, key) for key, fn in list(hooks.items()) if _holds(fn, ddp)]
    return found


def remove(found: list[tuple[dict, int]]) -> None:
    """Remove the hooks :func:`backward_hooks` found (each once; a removed one is skipped)."""
    for hooks, key in found:
        hooks.pop(key, None)
    found.clear()
