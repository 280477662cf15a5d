"""The ``mlp_projector`` layer type of ``llava.toml``: LLaVA-1.5's two-layer GELU MLP from the vision
encoder's width into the LLM's, tensor-parallel the Megatron way (column-parallel then row-parallel).

Registered from Python with :func:`megatron_spindle.planner.workload.layer_types.register_layer_type`: the cost
function is plain arithmetic (the planner imports this file without torch); the build function imports
torch and megatron.core only when a rank builds the layer, and takes its tensor-parallel group explicitly.

The layer gets ``[b, tokens, input_dim]`` (the vision encoder's output, batch first) and returns
``[b, tokens, hidden]``; ``ffn_hidden`` is the width between the two linears.
"""
from megatron_spindle.planner.workload.layer_types import LayerCost, register_layer_type

BF16_BYTES = 2


def cost(c) -> LayerCost:
    """Per sample: fc1 (input_dim -> ffn_hidden) and fc2 (ffn_hidden -> hidden), each with a bias."""
    params = c.input_dim * c.ffn_hidden + c.ffn_hidden + c.ffn_hidden * c.hidden + c.hidden
    flops = 2.0 * c.seq_len * (c.input_dim * c.ffn_hidden + c.ffn_hidden * c.hidden)
    stashed = BF16_BYTES * c.seq_len * (c.input_dim + 2 * c.ffn_hidden)  # fc1 input, fc1 output, GELU output
    return LayerCost(params=params, fwd_flops_per_sample=flops, act_bytes_per_sample=stashed)


def build(op, *, tp_group, tp_rank, tp_size, dtype):
    import torch
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    c = op.layer
    config = ModelParallelConfig(tensor_model_parallel_size=tp_size, use_cpu_initialization=True,
                                 params_dtype=dtype, perform_initialization=True)

    def init(w):
        return torch.nn.init.normal_(w, std=0.02)

    class MLPProjector(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_fc1 = ColumnParallelLinear(c.input_dim, c.ffn_hidden, config=config, init_method=init,
                                                   bias=True, gather_output=False, tp_group=tp_group)
            self.linear_fc2 = RowParallelLinear(c.ffn_hidden, c.hidden, config=config, init_method=init,
                                                bias=True, input_is_parallel=True, skip_bias_add=False,
                                                tp_group=tp_group)

        def forward(self, x):
            h, _ = self.linear_fc1(x)
            y, _ = self.linear_fc2(torch.nn.functional.gelu(h))
            return y

    return MLPProjector()


register_layer_type("mlp_projector", cost=cost, build=build, tensor_parallel=True)
