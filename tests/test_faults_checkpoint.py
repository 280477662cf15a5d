"""Checkpoint files under damage: a flipped bit, a missing or extra file, a crafted pickle, a full disk.

Every case runs in one 2-rank process group (process starts are the expensive part) and checks that every
rank refuses with the same one line, before anything in the checkpoint is unpickled, and that the checkpoint
that is there stays usable.
"""
import os
import pickle

from mp_harness import run_ranks

BASE = ["--spindle", "--spindle-size", "tiny", "--spindle-tasks", "4", "--micro-batch-size", "4",
        "--lr", "1e-3", "--seed", "7"]


class _Payload:
    """A pickle that runs code when loaded (touches a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model(world):
    from megatron_spindle.megatron.adapter.flags import build_parser
    from megatron_spindle.megatron.adapter.model import graph_for, plan_for
    from megatron_spindle.megatron.trainer.loop import make_optimizer
    from megatron_spindle.runtime.executor import SpindleModel
    args = build_parser().parse_args(BASE)
    g = graph_for(args, world)
    model = SpindleModel(plan_for(args, g, world), g, seed=7)
    return model, make_optimizer(model.unique_parameters(), args)


def _try_load(d, model, opt):
    from megatron_spindle.megatron.checkpoint.save_load import CheckpointError, load_checkpoint
    try:
        it, _, _ = load_checkpoint(d, model, opt)
        return f"ok {it}"
    except CheckpointError as e:
        return f"refused: {e}"


def _cases(rank, world, root):
    import torch.distributed as dist
    from megatron_spindle.megatron.checkpoint import files as F
    from megatron_spindle.megatron.checkpoint.save_load import checkpoint_bytes, save_checkpoint
    model, opt = _model(world)
    out = {}
    d = os.path.join(root, "ck")
    path = save_checkpoint(d, 1, model, opt)
    out["files"] = sorted(os.listdir(path))
    out["bytes"] = checkpoint_bytes(model, opt)
    out["clean"] = _try_load(d, model, opt)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    if rank == 0:  # flip one exponent bit in the middle of a shard
        with open(os.path.join(path, shard), "r+b") as fh:
            fh.seek(os.path.getsize(os.path.join(path, shard)) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x40]))
    dist.barrier()
    out["bitflip"] = _try_load(d, model, opt)
    if rank == 0:  # a crafted .metadata, with a manifest that matches it (an attacker can write both)
        marker = os.path.join(root, "pwned")
        with open(os.path.join(path, ".metadata"), "wb") as fh:
            pickle.dump(_Payload(marker), fh)
    dist.barrier()
    if rank == 0:
        import json
        m = json.load(open(os.path.join(path, F.MANIFEST)))
        for name in list(m["files"]):
            m["files"][name] = F.file_digest(os.path.join(path, name))
        json.dump(m, open(os.path.join(path, F.MANIFEST), "w"))
    dist.barrier()
    out["crafted"] = _try_load(d, model, opt)
    out["pwned"] = os.path.exists(os.path.join(root, "pwned"))
    if rank == 0:
        open(os.path.join(path, "extra.bin"), "wb").write(b"x")
    dist.barrier()
    out["extra"] = _try_load(d, model, opt)
    if rank == 0:
        os.unlink(os.path.join(path, F.MANIFEST))
    dist.barrier()
    out["no_manifest"] = _try_load(d, model, opt)
    model.destroy()
    return out


def test_damaged_checkpoints_are_refused_on_every_rank(tmp_path):
    res = run_ranks(_cases, 2, str(tmp_path), timeout_s=300)
    for r in res:
        assert r == res[0]  # every rank: the same outcome, the same line
    r = res[0]
    assert "manifest.json" in r["files"] and r["bytes"] > 0
    assert r["clean"] == "ok 1"
    assert r["bitflip"].startswith("refused: checkpoint ") and "does not match its checksum" in r["bitflip"]
    assert "refusing to load it" in r["crafted"] and "posix.system" in r["crafted"], r["crafted"]
    assert r["pwned"] is False
    assert "extra.bin is not in the manifest" in r["extra"]
    assert "has no manifest.json" in r["no_manifest"]
    for k in ("bitflip", "crafted", "extra", "no_manifest"):
        assert "\n" not in r[k]
