#!/usr/bin/env python3
"""The runtime's one-device checks on the real device (a step of scripts/gpu_check.sh): what the CPU emulation
cannot show.

One process, world size 1, its process group started the way the trainer starts it
(:func:`megatron_spindle.megatron.trainer.session.init_distributed`: NCCL on a GPU, gloo without). Prints one
JSON line per check, ``{"runtime_check": {"check": NAME, ...}}``; a check that raises is recorded with its
first line (what the device does is the result):

* ``new_group``: device memory per communicator: the device's free memory (``torch.cuda.mem_get_info``: NCCL
  allocates outside torch's allocator) before and after ``GROUPS`` new groups, each warmed by one all-reduce,
  less what torch's allocator reserved meanwhile. A one-rank communicator connects to no peer: this is its fixed
  part, not the per-channel buffers of one with peers (``planner/assembly/communicators.py`` charges those);
* ``replan``: the tiny Multitask-CLIP trained 2 steps with the trainer's AdamW on the device, then a task
  leaves and rejoins (two replans: a parked weight and the reused ones keep their state), every optimizer
  state tensor's dtype and device before and after (AdamW's ``step`` a float32 CPU tensor); and one weight's
  copy, parameters with their AdamW state, as ``runtime/replan.py`` sends it (one message per dtype) through
  the backend to this rank and loaded into a fresh optimizer: dtypes, devices and values kept (on gloo, which
  cannot send to itself, the messages are copied into the receive buffers);
* ``sync_debug``: 3 iterations of the built-in trainer; per iteration, the host's waits for the device
  (:mod:`megatron_spindle.runtime.host_sync`: on a GPU every CUDA call that torch's
  ``set_sync_debug_mode("warn")`` reports) and where they come from;
* ``timeout`` (NCCL only): a child process whose rank waits for a message nobody sends, its process group's
  timeout ``HANG_TIMEOUT_S``: NCCL's watchdog aborts the communicator, the next call raises, and the run ends
  with one line and exit status 3 (``comm.NCCL_ASYNC_ERROR_HANDLING``); the child's status, its last lines and
  seconds.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from megatron_spindle import comm
from megatron_spindle.megatron.trainer.session import init_distributed, run_entry

GROUPS = 4
HANG_TIMEOUT_S = 8.0
TASKS = ("vision-text", "audio-text", "vision-depth", "vision-thermal")


def emit(check: str, **fields) -> None:
    print(json.dumps({"runtime_check": {"check": check, **fields}}, default=str), flush=True)


def guarded(check: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fields = fn()
    except Exception as e:  # noqa: BLE001 - the device's answer is the result
        fields = {"error": f"{type(e).__name__}: {comm.first_line(e)}"}
    emit(check, seconds=round(time.perf_counter() - t0, 2), **fields)


def new_group_memory() -> dict:
    dev = comm.comm_device()
    if dev.type != "cuda":
        return {"device": "cpu", "bytes_per_group": None, "note": "gloo holds no device memory"}
    torch.cuda.synchronize()
    free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    groups = [dist.new_group([0]) for _ in range(GROUPS)]
    for g in groups:
        comm.all_reduce(torch.ones(1, device=dev), group=g)
    torch.cuda.synchronize()
    free1, reserved1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    for g in groups:
        dist.destroy_process_group(g)
    per = (free0 - free1 - (reserved1 - reserved0)) / GROUPS
    return {"device": torch.cuda.get_device_name(0), "groups": GROUPS, "peers": 0,
            "bytes_per_group": int(per), "mib_per_group": round(per / 2**20, 2),
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
            "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}


def _signature(model, opt) -> dict:
    """(param_key, name, state key) -> (dtype, device) of every optimizer state tensor this rank holds."""
    out = {}
    for key, _, mod in model.local_cores():
        for n, p in mod.core.named_parameters():
            for k, t in opt.state.get(p, {}).items():
                if torch.is_tensor(t):
                    out[f"{key}/{n}/{k}"] = (str(t.dtype), str(t.device))
    return out


def replan_with_adamw() -> dict:
    from megatron_spindle.megatron.adapter.model import run_device
    from megatron_spindle.megatron.trainer.loop import make_optimizer
    from megatron_spindle.models.data import SyntheticData
    from megatron_spindle.planner.step.build import make_plan
    from megatron_spindle.planner.workload.cluster import load_cluster
    from megatron_spindle.planner.workload.workloads import build_graph
    from megatron_spindle.runtime import replan as rp
    from megatron_spindle.runtime.executor import SpindleModel

    class Args:
        lr, adam_beta1, adam_beta2, adam_eps, weight_decay = 1e-3, 0.9, 0.999, 1e-8, 0.01

    run_device()  # the CPU stand-ins of megatron.core where there is no GPU
    g = build_graph("multitask-clip", tasks=4, size="tiny", batch=4)
    cluster = load_cluster(None, num_devices=1)
    model = SpindleModel(make_plan(g, cluster), g, seed=0)
    opt = make_optimizer(model.trainable_parameters(), Args)
    data = SyntheticData(g, seed=0)
    for step in range(2):
        model.backward(model(data.batch(step)))
        model.finalize_grads()
        opt.step()
        opt.zero_grad()
    before = _signature(model, opt)
    three = g.subset(TASKS[:3])
    model, opt = rp.replan(model, opt, make_plan(three, cluster), three, layer_graph=g,
                           make_optimizer=lambda ps: make_optimizer(ps, Args))
    parked = len(model.parked)
    model, opt = rp.replan(model, opt, make_plan(g, cluster), g, layer_graph=g,
                           make_optimizer=lambda ps: make_optimizer(ps, Args))
    after = _signature(model, opt)
    model.backward(model(data.batch(2)))  # and it trains on
    model.finalize_grads()
    opt.step()
    # one copy through the backend to this rank, as a replan between ranks sends it
    key, _, layer = next((k, s, m) for k, s, m in model.local_cores() if any(
        opt.state.get(p) for p in m.core.parameters()))
    states = {n: {k: v for k, v in opt.state[p].items() if torch.is_tensor(v)}
              for n, p in layer.core.named_parameters() if opt.state.get(p)}
    spec = rp.describe(layer, states)
    msgs, bufs = rp.messages(layer, states), rp.buffers(spec)
    if comm.is_nccl():
        ops = [op for i, (m, b) in enumerate(zip(msgs, bufs))
               for op in (comm.send_op(m, 0, tag=i), comm.recv_op(b, 0, tag=i))]
        works = comm.batch_isend_irecv(ops)
        comm.wait_all(works, ["a copy sent to this rank"] * len(works), datetime.timedelta(seconds=60))
        torch.cuda.synchronize()
        through = "nccl, to this rank"
    else:
        for m, b in zip(msgs, bufs):
            b.copy_(m)
        through = "copied (gloo cannot send to itself)"
    fresh = make_optimizer(model.trainable_parameters(), Args)
    rp.load_copy(layer, rp.unflatten(spec, bufs), spec, fresh)
    kept = all(str(fresh.state[p][k].dtype) == str(t.dtype) and fresh.state[p][k].device == t.device
               and torch.equal(fresh.state[p][k], t)
               for n, p in layer.core.named_parameters() for k, t in states.get(n, {}).items())
    step_kinds = sorted({v for k, v in after.items() if k.endswith("/step")})
    model.destroy()
    return {"device": str(comm.comm_device()), "state_tensors": len(before), "parked_while_away": parked,
            "state_kept": after == before, "step": step_kinds,
            "copy": {"weight": key, "messages": [str(m.dtype) for m in msgs], "through": through, "kept": kept}}


def sync_debug() -> dict:
    from megatron_spindle.megatron.adapter.flags import build_parser
    from megatron_spindle.megatron.trainer.loop import Trainer

    args = build_parser().parse_args(["--spindle", "--spindle-size", "tiny", "--spindle-tasks", "4",
                                      "--micro-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
                                      "--log-interval", "10", "--spindle-predict-interval", "0"])
    trainer = Trainer(args)
    try:
        summary = trainer.train()
        counter = trainer.syncs
        return {"mode": "sync debug mode (warn)" if counter.cuda else "the package's tensor reads (CPU)",
                "per_step": counter.per_step, "host_syncs_per_step": summary["host_syncs_per_step"],
                "sites": dict(counter.sites.most_common(8))}
    finally:
        trainer.close()


def hang_child() -> int:
    """The child of the ``timeout`` check: a receive nobody sends, under the run's exit handling."""
    def fn():
        init_distributed(HANG_TIMEOUT_S)
        buf = comm.empty((1024,), torch.float32)
        works = comm.batch_isend_irecv([comm.recv_op(buf, 0, tag=0)])
        comm.wait_all(works, ["a receive nobody sends"], datetime.timedelta(seconds=HANG_TIMEOUT_S))
        torch.cuda.synchronize()  # the host waits for the stream, until the watchdog aborts the communicator
        comm.all_reduce(torch.zeros(1, device=comm.comm_device()))  # the next call raises
    return run_entry(fn)


def timeout_check() -> dict:
    if not comm.is_nccl():
        return {"skipped": "gloo: a rank cannot receive from itself (the CPU tests hang a peer instead)"}
    env = {**os.environ, "MASTER_PORT": str(int(os.environ.get("MASTER_PORT", "29657")) + 1)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "--hang"], env=env, capture_output=True, text=True,
                           timeout=HANG_TIMEOUT_S * 4)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stderr or ""
        rc, err = "hung", out.decode(errors="replace") if isinstance(out, bytes) else out
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return {"exit": rc, "seconds": round(time.perf_counter() - t0, 1), "timeout_s": HANG_TIMEOUT_S,
            "error_lines": [ln for ln in lines if ln.startswith("error: ")], "last_lines": lines[-3:]}


def main() -> int:
    if sys.argv[1:] == ["--hang"]:
        return hang_child()
    os.environ.setdefault("MASTER_PORT", "29657")
    init_distributed(120.0)
    try:
        guarded("new_group", new_group_memory)
        guarded("replan", replan_with_adamw)
        guarded("sync_debug", sync_debug)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    guarded("timeout", timeout_check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
