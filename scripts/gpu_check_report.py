#!/usr/bin/env python3
"""The summary of scripts/gpu_check.sh, rewritten after every step (so a run cut off anywhere still reports).

``gpu_check_report.py WORK OUT``: reads the step plan (``WORK/plan.json``: device, steps in order with their
time budgets) and each finished step's ``WORK/<step>.log``/``.rc``/``.seconds``, and writes, each atomically,

* ``OUT/gpu_check.json``: ``{"gpu_check": {...run...}, "steps": {finished step: result}, "pending": [...]}``,
  valid and complete for the steps so far after every step;
* ``OUT/logs.tar.gz``: every step's whole log.

Pure standard library (no torch), so it takes a moment.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys
import tarfile


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _json_lines(log: str, key: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        if line.startswith("{") and f'"{key}"' in line:
            try:
                out.append(json.loads(line)[key])
            except (ValueError, KeyError, TypeError):
                pass
    return out


def _last(pattern: str, log: str):
    m = re.findall(pattern, log)
    return m[-1] if m else None


def training(log: str, entry: dict) -> None:
    """fp32 / bf16: the equivalence, the final loss and step time, and that the built-in loop ran."""
    entry["equivalence"] = _last(r"equivalence: max relative difference (\S+)", log)
    summary = [json.loads(line) for line in log.splitlines() if line.startswith('{"steps"')]
    if summary:
        entry.update(final_loss=summary[-1].get("final_loss"), step_time_s=summary[-1].get("step_time_s"),
                     host_syncs_per_step=summary[-1].get("host_syncs_per_step"))
    entry["loop"] = "built-in" if "training with the built-in megatron.core trainer" in log else None
    entry["ok"] = entry["ok"] and entry["equivalence"] is not None and entry["loop"] == "built-in"


def megatron(log: str, entry: dict) -> None:
    entry["last_iteration"] = _last(r"iteration\s+(\d+)/\s*\d+ \|", log)
    entry["grad_norm"] = _last(r"grad norm: ([0-9.]+)", log)
    entry["validation"] = _last(r"validation loss at iteration \d+ (?:on validation set )?\| (.*?) \|", log)
    entry["ok"] = entry["ok"] and entry["last_iteration"] == "5" and entry["validation"] is not None


def nccl(log: str, entry: dict) -> None:
    found = _json_lines(log, "nccl_check")
    if found:
        entry.update(found[-1])
    entry["ok"] = entry["ok"] and bool(found)


def runtime(log: str, entry: dict) -> None:
    """The runtime's one-device checks, by name; ok when none raised, the replan kept every state tensor's
    dtype and device and the copy's values, the host's waits were counted, and a hung receive (NCCL) ended
    with exit status 3."""
    checks = {c["check"]: c for c in _json_lines(log, "runtime_check")}
    entry["checks"] = checks
    replan, syncs, hang = checks.get("replan", {}), checks.get("sync_debug", {}), checks.get("timeout", {})
    entry["ok"] = (entry["ok"] and set(checks) == {"new_group", "replan", "sync_debug", "timeout"}
                   and not any("error" in c for c in checks.values())
                   and replan.get("state_kept") is True and replan.get("copy", {}).get("kept") is True
                   and syncs.get("host_syncs_per_step") is not None
                   and ("skipped" in hang or hang.get("exit") == 3))


def curves(log: str, entry: dict) -> None:
    entry["models"] = {c["model"]: c for c in _json_lines(log, "curves")}
    entry["ok"] = entry["ok"] and len(entry["models"]) == 3


def compare(work: str, entry: dict) -> None:
    """Per model and device count: each system's simulated step (ms) and Spindle's speedup over each."""
    models = {}
    for path in sorted(glob.glob(os.path.join(work, "compare_*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            models[os.path.basename(path)] = {"error": "no JSON (see the log)"}
            continue
        rows = {}
        for r in doc["results"]:
            step = {k: v.get("step_ms") for k, v in r["systems"].items()}
            ours = step.get("spindle")
            rows[str(r["gpus"])] = {"step_ms": step, "cluster": r["cluster"], "spindle_speedup": {
                k: round(v / ours, 3) for k, v in step.items() if ours and v and k != "spindle"}}
        models[doc["results"][0]["model"] if doc["results"] else path] = rows
    entry["models"] = models
    entry["ok"] = entry["ok"] and len(models) == 3 and all("error" not in m for m in models.values())


def wheels(log: str, entry: dict) -> None:
    entry["installed"] = re.findall(r"^installed (\S+)$", log, flags=re.M)


PARSE = {"fp32": training, "bf16": training, "megatron": megatron, "nccl": nccl, "runtime": runtime,
         "curves": curves, "wheels": wheels}


def step_result(work: str, name: str, budget: int) -> dict:
    rc = _read(os.path.join(work, f"{name}.rc")).strip()
    log = _read(os.path.join(work, f"{name}.log"))
    entry = {"ok": rc == "0", "exit": int(rc) if rc.lstrip("-").isdigit() else None,
             "seconds": int(_read(os.path.join(work, f"{name}.seconds")).strip() or 0), "budget_s": budget}
    if entry["exit"] == 124:
        entry["timed_out"] = True
    if name == "compare":
        compare(work, entry)
    elif name in PARSE:
        PARSE[name](log, entry)
    if not entry["ok"]:
        entry["tail"] = log.strip().splitlines()[-4:]
    return entry


def _atomic(path: str, write) -> None:
    tmp = f"{path}.tmp"
    write(tmp)
    os.replace(tmp, path)


def report(work: str, out: str) -> dict:
    with open(os.path.join(work, "plan.json")) as f:
        plan = json.load(f)
    steps, pending = {}, []
    for name, budget in plan["steps"]:
        if os.path.exists(os.path.join(work, f"{name}.rc")):
            steps[name] = step_result(work, name, budget)
        else:
            pending.append(name)
    budgets = dict(plan["steps"])
    run = {**plan["run"], "budgets_s": budgets, "budget_total_s": sum(budgets.values()),
           "seconds": sum(s["seconds"] for s in steps.values()), "complete": not pending,
           "ok": not pending and all(s["ok"] for s in steps.values())}
    doc = {"gpu_check": run, "steps": steps, "pending": pending}
    def write(p: str) -> None:
        with open(p, "w") as f:
            f.write(json.dumps(doc, indent=1) + "\n")

    _atomic(os.path.join(out, "gpu_check.json"), write)

    def tar(p: str) -> None:
        with tarfile.open(p, "w:gz") as t:
            for log in sorted(glob.glob(os.path.join(work, "*.log")) + glob.glob(os.path.join(work, "compare_*.json"))):
                t.add(log, arcname=os.path.basename(log))

    _atomic(os.path.join(out, "logs.tar.gz"), tar)
    return doc


if __name__ == "__main__":
    d = report(sys.argv[1], sys.argv[2])
    print(json.dumps({"gpu_check": d["gpu_check"], "pending": d["pending"],
                      "steps": {k: v["ok"] for k, v in d["steps"].items()}}))
