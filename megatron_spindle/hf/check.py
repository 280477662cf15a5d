"""``spindle hf check``: a Hugging Face model in our layers and in ``transformers``, the same input through both.

Every rank builds the model of ``spindle hf spec DIR --model-spec`` with Spindle's layers (tensor-parallel
over all ranks where the layer type allows it), loads the checkpoint the way a training run does
(:func:`megatron_spindle.models.pretrained.load_pretrained`, each rank its shards), and runs a random batch
(pixels cut into patches channel first, token ids ending with EOS for CLIP's text tower). Rank 0 also runs
the ``transformers`` model (``from_pretrained`` with ``local_files_only``; ``HF_HUB_OFFLINE=1``) and
compares, per output, ``max |ours - theirs| / max |theirs|``:

* CLIP vision: the last layer's hidden states, the pooled ``post_layernorm`` output, ``image_embeds``;
* CLIP text: ``final_layer_norm`` over the last layer's hidden states, the pooled output, ``text_embeds``;
* Llama / Qwen2: the logits (gathered over the tensor-parallel ranks).
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..compat.cpu import apply_cpu_patches
from ..models.hf_config import model_spec_toml, read_config, towers
from ..models.layers import build_layer
from ..models.pretrained import load_pretrained
from ..planner.workload.spec import parse_spec


def make_inputs(path: str, batch: int, seed: int) -> dict:
    """The same random inputs on every rank: ``pixel_values`` and their patches, ``input_ids``."""
    cfg = read_config(path)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in towers(path):
        if t.name == "vision":
            sub = cfg.get("vision_config", cfg)
            p, size, ch = sub.get("patch_size", 32), sub.get("image_size", 224), sub.get("num_channels", 3)
            pix = torch.randn(batch, ch, size, size, generator=g)
            patches = pix.unfold(2, p, p).unfold(3, p, p)  # [b, c, gh, gw, p, p]
            out["pixel_values"] = pix
            out["patches"] = patches.permute(0, 2, 3, 1, 4, 5).reshape(batch, (size // p) ** 2, ch * p * p)
        else:
            m = t.modules["embed"]
            vocab = m["vocab_size"]
            seq = min(64, m.get("seq_length", 64))
            ids = torch.randint(0, vocab - 1, (batch, seq), generator=g)
            if t.name == "text":  # pooled at the EOS token: put it last (the largest id for legacy eos 2)
                sub = cfg.get("text_config", cfg)
                eos = sub.get("eos_token_id", 2)
                ids[ids == eos] = (eos + 1) % (vocab - 1)
                ids[:, -1] = vocab - 1 if eos == 2 else eos
            out["input_ids"] = ids
    return out


def _ours(path: str, inputs: dict, tp: int, rank: int, batch: int) -> dict[str, torch.Tensor]:
    ts = towers(path)
    seq = inputs["input_ids"].shape[1] if "input_ids" in inputs else 64
    spec = parse_spec(model_spec_toml(path, ts, name="hf-check", batch=batch, seq_length=seq), f"{path} (hf check)")
    graph = spec.build_graph(batch=batch)
    group = dist.group.WORLD if tp > 1 else None
    layers, by_key = {}, {}
    for op in graph.operators:
        split = tp > 1 and op.tp_splittable
        layers[op.name] = build_layer(op, tp_group=group if split else None, tp_rank=rank if split else 0,
                                      tp_size=tp if split else 1, seed=0, graph=graph,
                                      share_with=by_key.get(op.param_key))
        by_key.setdefault(op.param_key, layers[op.name])
    load_pretrained([by_key[k] for k in by_key if k], graph, spec.init)
    data = {"vision": inputs.get("patches"), "text": inputs.get("input_ids")}
    acts, out = {}, {}
    with torch.no_grad():
        for op in graph.operators:
            if op.op_type in ("contrastive_loss", "lm_head"):
                continue
            xs = [data[n.rsplit(":", 1)[1]] if n.startswith("data:") else acts[n] for n in op.inputs]
            layer = layers[op.name]
            if op.op_type == "pool_head":
                tower = op.module
                h = layer.core.norm(xs[0])
                if tower == "text":
                    out["text last_hidden_state"] = h
                else:
                    out["vision last_hidden_state"] = xs[0]
                out[f"{tower} pooler_output"] = h[:, 0] if op.layer.pooling == "cls" else h[:, -1]
                if any(t.projection for t in ts if t.name == tower):
                    out[f"{'image' if tower == 'vision' else 'text'}_embeds"] = layer(xs)
            acts[op.name] = layer(xs)
        head = next((op for op in graph.operators if op.op_type == "lm_head"), None)
        if head is not None:
            core, x = layers[head.name].core, acts[head.inputs[0]]
            logits, _ = core.output(core.norm(x))
            if tp > 1:
                logits = torch.cat(comm.all_gather(logits.contiguous(), group=group), dim=-1)
            out["logits"] = logits
    return out


def _theirs(path: str, inputs: dict) -> dict[str, torch.Tensor]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the hub: a local directory only
    try:
        import transformers  # optional: transformers (pip install .[hf])
    except ImportError:
        raise ValueError("spindle hf check needs transformers: pip install .[hf]") from None
    cfg = read_config(path)
    arch = (cfg.get("architectures") or ["CLIPModel" if cfg["model_type"] == "clip" else ""])[0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ValueError(f"{path}/config.json: architectures {arch!r} is not a transformers class")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = cls.from_pretrained(path, local_files_only=True, attn_implementation="eager",
                                dtype=torch.float32).eval()
    kw = {k: inputs[k] for k in ("pixel_values", "input_ids") if k in inputs}
    with torch.no_grad():
        res = model(**kw)
    out = {}
    if cfg["model_type"] in ("llama", "qwen2"):
        return {"logits": res.logits}
    if cfg["model_type"] == "clip":
        parts = [(res.vision_model_output, "vision"), (res.text_model_output, "text")]
        out["image_embeds"], out["text_embeds"] = res.image_embeds, res.text_embeds
    else:
        parts = [(res, "vision" if cfg["model_type"] == "clip_vision_model" else "text")]
        for name in ("image_embeds", "text_embeds"):  # the ...WithProjection models: not normalised
            if getattr(res, name, None) is not None:
                out[name] = F.normalize(getattr(res, name), dim=-1)
    for sub, tower in parts:  # CLIPModel's pooler_output is already projected: the embeds cover it
        out[f"{tower} last_hidden_state"] = sub.last_hidden_state
        if cfg["model_type"] != "clip" and getattr(sub, "pooler_output", None) is not None:
            out[f"{tower} pooler_output"] = sub.pooler_output
    return out


def compare(rank: int, world: int, path: str, batch: int = 2, seed: int = 0) -> list[tuple[str, list, float]] | None:
    """On every rank of a ``world``-rank job (the tensor-parallel degree): ``[(output, shape, relative
    difference)]`` on rank 0, None elsewhere."""
    apply_cpu_patches()
    warnings.filterwarnings("ignore", message="When using async grad allreduce")  # a CUDA tuning hint
    inputs = make_inputs(path, batch, seed)
    ours = _ours(path, inputs, world, rank, batch)
    if rank != 0:
        return None
    theirs = _theirs(path, inputs)
    rows = []
    for name, ref in theirs.items():
        mine = ours[name]
        if mine.shape != ref.shape:
            raise ValueError(f"{name}: ours {list(mine.shape)}, transformers {list(ref.shape)}")
        diff = float((mine.detach().double() - ref.detach().double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))
        rows.append((name, list(ref.shape), diff))
    return rows
