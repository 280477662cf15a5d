"""``spindle compare``: the table, the JSON shape, the plot, and clear errors on bad input."""
import json

import pytest

from megatron_spindle.cli import main
from megatron_spindle.planner.systems.baselines import SYSTEMS

TINY = ["compare", "--model", "multitask-clip", "--size", "tiny", "--tasks", "4"]


def run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_has_every_system_per_device_count(capsys):
    rc, out, err = run(capsys, TINY + ["--gpus", "4,8", "--json"])
    assert rc == 0, err
    doc = json.loads(out)
    assert [r["gpus"] for r in doc["results"]] == [4, 8]
    for r in doc["results"]:
        assert r["lower_bound_ms"] > 0 and r["tuned"] is True
        assert r["usable_memory_gib"] == pytest.approx(72.0) and "memory per device" in r["memory_note"]
        assert set(r["systems"]) == set(SYSTEMS)
        for name, s in r["systems"].items():
            if "error" in s:  # the static grids need a device per module: 6 modules on 4 devices do not fit
                assert name == "static-grids" and r["gpus"] == 4 and "at least 6 devices" in s["error"], s
                continue
            assert set(s["breakdown"]) == {"compute_ms", "transfer_ms", "sync_ms", "idle_ms"}, name
            assert s["step_ms"] == pytest.approx(sum(s["breakdown"].values()))
            assert s["peak_memory_gib"] > 0 and s["peak_memory_gib"] == pytest.approx(s["memory"]["max_gib"])
            m = s["memory"]  # memory per device: its peak, and how it spreads over the devices
            assert m["min_gib"] <= m["mean_gib"] <= m["max_gib"] and m["spread_gib"] == pytest.approx(
                m["max_gib"] - m["min_gib"]) and m["stdev_gib"] >= 0
            if s["makespan_ms"] is not None:  # a per-pass compute figure only for level-by-level waves
                assert s["level_by_level"] is True
            assert s["configuration"]["passes"] >= 1 and s["configuration"]["label"].startswith("P=")
            if name != "spindle-naive-placement":  # each tuner says what it tried; the best is among them
                fits = [t["step_ms"] for t in s["tried"] if t["fits"] and t["step_ms"] is not None]
                assert s["step_ms"] == pytest.approx(min(fits)), name


def test_fixed_passes_holds_every_system_to_one_configuration(capsys):
    rc, out, err = run(capsys, TINY + ["--gpus", "8", "--json", "--fixed-passes", "--passes", "2"])
    assert rc == 0, err
    r = json.loads(out)["results"][0]
    assert r["tuned"] is False
    assert {s["configuration"]["label"] for s in r["systems"].values()} == {"P=2 recompute=none"}


def test_table_and_plot(capsys, tmp_path):
    png = tmp_path / "fig8.png"
    rc, out, err = run(capsys, TINY + ["--gpus", "8", "--plot", str(png)])
    assert rc == 0, err
    assert "multitask-clip (4 tasks) on 8 devices, cluster a800-8x8 (8 per island), each system at its own best " \
           "configuration\n" in out
    assert "configuration" in out and "P=1 recompute=none" in out and "mem spread GiB" in out
    for name in SYSTEMS:
        assert f"\n{name} " in out
    assert "\nmemory per device (peak of each device, 72.0 GiB usable): Spindle max " in out
    assert "whole step" not in out.split("\nMFU")[0]  # no step over a per-pass compute bound
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cluster_file_and_h200_preset(capsys, tmp_path):
    f = tmp_path / "slow.json"
    f.write_text(json.dumps({"inter_bandwidth_gbps": 1.0}))
    rc, out, _ = run(capsys, TINY + ["--gpus", "16", "--json", "--cluster", str(f)])
    assert rc == 0 and json.loads(out)["results"][0]["cluster"] == str(f)
    rc, out, _ = run(capsys, TINY + ["--gpus", "8", "--json", "--cluster", "h200"])
    assert rc == 0 and json.loads(out)["results"][0]["cluster"] == "h200"


def test_curves_file_replaces_the_analytic_device(capsys, tmp_path):
    f = tmp_path / "curves.json"
    f.write_text(json.dumps({"schema_version": 1, "device": {"peak_tflops": 31.2}}))
    rc, out, _ = run(capsys, TINY + ["--gpus", "8", "--json"])
    fast = json.loads(out)["results"][0]["systems"]["sequential"]["breakdown"]["compute_ms"]
    rc, out, _ = run(capsys, TINY + ["--gpus", "8", "--json", "--curves", str(f)])
    assert rc == 0
    assert json.loads(out)["results"][0]["systems"]["sequential"]["breakdown"]["compute_ms"] > fast


def test_bad_input_is_one_clear_error(capsys, tmp_path):
    rc, out, err = run(capsys, TINY + ["--gpus", "8", "--cluster", "dgx-a100"])
    assert rc == 2 and "error: unknown cluster preset 'dgx-a100'" in err and out == ""
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    rc, _, err = run(capsys, TINY + ["--gpus", "8", "--cluster", str(bad)])
    assert rc == 2 and "is not valid JSON" in err
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--gpus", "8,sixteen"])
    assert e.value.code == 2
    assert "'sixteen' is not an integer" in capsys.readouterr().err


def test_out_of_memory_is_reported_not_hidden(capsys, tmp_path):
    f = tmp_path / "small.json"
    f.write_text(json.dumps({"memory_gib": 1e-5}))  # 10 KiB: not even recompute, ZeRO-1 and TP 8 fit
    rc, out, err = run(capsys, TINY + ["--gpus", "8", "--cluster", str(f)])
    assert rc == 2
    assert "Spindle has no plan on 8 devices: no configuration fits the devices' memory" in err
    assert "sequential: no configuration fits the devices' memory" in out
    # held to one configuration, a plan over memory is timed all the same and flagged
    rc, out, err = run(capsys, TINY + ["--gpus", "8", "--cluster", str(f), "--fixed-passes"])
    assert rc == 2 and "sequential: needs" in out and "GiB usable" in out
