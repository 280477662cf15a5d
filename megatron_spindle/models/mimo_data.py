"""Synthetic token streams of a MIMO task, and inputs for profiling MIMO operators.

A sample of a task is ``seq_length`` tokens: each modality's special token id, as many times as its encoder hands
the language model tokens, in the order the task names them (as Megatron-LM's MIMO mock data puts the image
tokens first), then text. Text follows a fixed affine recurrence ``t' = (a t + c) mod V'`` over the vocabulary
without the special ids (``V'`` ids), from a start token read off the sample's latent vector, so next-token
prediction is learnable and the images, generated from the same latent (:class:`.data.SyntheticData`), go with
their text. ``labels[i]`` is ``input_ids[i + 1]`` on text positions; ``loss_mask`` is 1 on every text position but
the last (the graph's ``loss_tokens``), 0 elsewhere, where ``labels`` is 0.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from ..planner.workload.graph import DATA_PREFIX
from .data import parse_data_input
from .shapes import output_shape


def _gen(*parts) -> torch.Generator:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def task_modalities(op) -> list[str]:
    """The modalities whose projections feed a ``mimo_lm_embed`` operator, in order."""
    return [n.split(".")[1] for n in op.inputs if not n.startswith(DATA_PREFIX)]


def layout(op, description) -> list[tuple[str, int]]:
    """``[(modality, tokens)]`` at the start of each sample of the embedding operator ``op``'s task."""
    return [(m, description.modality(m).encoder.tokens) for m in task_modalities(op)]


def token_streams(op, z: Tensor, seed: int, description) -> dict[str, Tensor]:
    """``{input_ids, labels, loss_mask}`` of ``z.shape[0]`` samples of the embedding operator ``op``'s task."""
    S, V = op.layer.seq_len, op.layer.vocab_size
    specials = dict(description.special_tokens)
    valid = torch.tensor([t for t in range(V) if t not in set(specials.values())], dtype=torch.int64)
    b = z.shape[0]
    ids = torch.zeros((b, S), dtype=torch.int64)
    pos = 0
    for m, n in layout(op, description):
        ids[:, pos:pos + n] = specials[m]
        pos += n
    g = _gen(seed, "mimo-text")
    a = int(torch.randint(1, max(2, len(valid)), (1,), generator=g))
    c = int(torch.randint(0, len(valid), (1,), generator=g))
    proj = torch.randn(z.shape[1], len(valid), generator=_gen(seed, "mimo-text-start"))
    t = (z @ proj).argmax(dim=-1)
    for i in range(pos, S):
        ids[:, i] = valid[t]
        t = (a * t + c) % len(valid)
    labels = torch.zeros((b, S), dtype=torch.int64)
    labels[:, pos:S - 1] = ids[:, pos + 1:S]
    mask = torch.zeros((b, S), dtype=torch.float32)
    mask[:, pos:S - 1] = 1.0
    return {"input_ids": ids, "labels": labels, "loss_mask": mask}


def example_inputs(op, batch: int, description, *, graph=None, generator=None, dtype=torch.float32, device=None,
                   requires_grad: bool = False) -> list[Tensor]:
    """Inputs of a MIMO operator for ``batch`` samples (``spindle profile``): random activations and float
    streams, token streams laid out as a task's (:func:`token_streams`)."""
    out = []
    tokens = None
    for i, name in enumerate(op.inputs):
        if not name.startswith(DATA_PREFIX):
            if graph is not None:
                shape = output_shape(graph[name])
            elif op.op_type == "mimo_lm_embed":
                m = name.split(".")[1]
                shape = (description.modality(m).encoder.tokens, op.layer.hidden)
            else:
                c = op.layer
                shape = (c.input_seq_len or c.seq_len, c.input_dim or c.hidden)
            x = torch.randn((batch, *shape), generator=generator).to(dtype=dtype, device=device)
            out.append(x.requires_grad_(requires_grad))
            continue
        stream = parse_data_input(name)[1]
        if stream in ("input_ids", "labels", "loss_mask"):
            if tokens is None:
                tokens = _tokens(op, batch, description, generator)
            out.append(tokens[stream].to(device))
            continue
        enc = next(m.encoder for m in description.modalities if stream.startswith(f"{m.name}.{m.encoder.name}."))
        shape = next(s.shape for s in enc.inputs if stream.endswith("." + s.name))
        out.append(torch.randn((batch, *shape), generator=generator).to(dtype=dtype, device=device))
    return out


def _tokens(op, batch, description, generator) -> dict[str, Tensor]:
    z = torch.randn((batch, 8), generator=generator)
    if op.op_type == "mimo_lm_embed":
        return token_streams(op, z, 0, description)
    c = op.layer  # the head: a sample's loss positions are its last loss_tokens + 1 tokens but the final one
    S, V = c.seq_len, c.vocab_size
    mask = torch.zeros((batch, S))
    mask[:, S - 1 - c.loss_tokens:S - 1] = 1.0
    return {"labels": torch.randint(0, V, (batch, S), generator=generator), "loss_mask": mask}
