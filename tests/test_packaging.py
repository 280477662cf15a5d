"""The plugin installs into a user's Megatron environment without replacing its torch or megatron-core.

A Megatron environment already holds torch and megatron-core (the GPU machines': torch 2.11.0+cu130 beside
megatron-core 0.19.2). ``pip install megatron_spindle[runtime]`` there must keep both. Checked offline, in
seconds, by pip's own resolver:

* the package's wheel is built from this checkout (setup.py as it is);
* a scratch venv (no pip, no packages) gets stub ``*.dist-info`` folders for the environment's packages: a
  METADATA file is all pip needs to count a distribution as installed;
* a local wheel folder offers stub wheels of the versions ``requirements.txt`` pins (torch 2.13.0,
  megatron-core 0.16.1, ...), so a pin that differs from the environment's has something to replace it with;
* ``pip --python <venv> install --dry-run --no-index --find-links <folder> --report`` says what it would install.

A control case resolves a package that pins ``torch==2.13.0`` and ``megatron-core==0.16.1`` (the metadata
before the ranges) against the same environment: pip would replace both, which the assertion catches.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
KEEP = ("torch", "megatron-core")

#: Installed sets: the GPU machine's (scripts/gpu_check.sh; numpy 1.x to check numpy is not forced either)
#: and the one `make test` installs.
ENVIRONMENTS = {
    "gpu-machine": {"torch": "2.11.0+cu130", "megatron-core": "0.19.2", "numpy": "1.26.4", "einops": "0.8.1"},
    "make-test": {"torch": "2.13.0", "megatron-core": "0.16.1", "numpy": "2.4.6", "einops": "0.8.2"},
}


def pins(path: Path) -> dict[str, str]:
    """name -> version of every ``name==version`` line of a requirements file."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9_.-]+)==([^\s#;]+)", line)
        if m:
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def metadata(name: str, version: str, requires=()) -> str:
    extras = sorted({m for r in requires for m in re.findall(r'extra == "([^"]+)"', r)})
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Provides-Extra: {e}" for e in extras] + [f"Requires-Dist: {r}" for r in requires]
    return "\n".join(lines) + "\n"


def stub_wheel(folder: Path, name: str, version: str, requires=()) -> None:
    stem = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as z:
        z.writestr(f"{stem}.dist-info/METADATA", metadata(name, version, requires))
        z.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{stem}.dist-info/RECORD", "")


def pip(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PIP_NO_CACHE_DIR="1")
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """This checkout's wheel, and stub wheels of every pinned version the runtime extra could pull."""
    tmp = tmp_path_factory.mktemp("packaging")
    src, house = tmp / "src", tmp / "wheels"
    src.mkdir()
    house.mkdir()
    shutil.copy(ROOT / "setup.py", src)
    shutil.copytree(ROOT / "megatron_spindle", src / "megatron_spindle",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(house), str(src), cwd=tmp)
    assert built.returncode == 0, built.stderr
    for name, version in pins(ROOT / "requirements.txt").items():
        stub_wheel(house, name, version)
    stub_wheel(house, "pinned-plugin", "0.1.0", [f'{n}=={v}; extra == "runtime"'
                                                 for n, v in (("torch", "2.13.0"), ("megatron-core", "0.16.1"))])
    return house


def would_install(tmp: Path, house: Path, installed: dict[str, str], requirement: str) -> dict[str, str]:
    """What ``pip install --dry-run requirement`` would install into a venv holding ``installed``."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for name, version in installed.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(metadata(name, version))
        (info / "INSTALLER").write_text("stub\n")
        (info / "RECORD").write_text("")
    report = tmp / "report.json"
    run = pip("--python", str(python), "install", "--dry-run", "--no-index", "--find-links", str(house),
              "--report", str(report), "--quiet", requirement, cwd=tmp)
    assert run.returncode == 0, run.stderr
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]}


@pytest.mark.parametrize("environment", sorted(ENVIRONMENTS))
def test_runtime_extra_keeps_the_environments_torch_and_megatron_core(environment, wheelhouse, tmp_path):
    installed = ENVIRONMENTS[environment]
    plan = would_install(tmp_path, wheelhouse, installed, "megatron_spindle[runtime]")
    assert "megatron-spindle" in plan, plan
    replaced = {n: f"{installed[n]} -> {plan[n]}" for n in plan if n in installed}
    assert replaced == {}, f"pip would replace {replaced} in the {environment} environment"


def test_the_check_catches_pins_that_replace_the_environments_packages(wheelhouse, tmp_path):
    plan = would_install(tmp_path, wheelhouse, ENVIRONMENTS["gpu-machine"], "pinned-plugin[runtime]")
    assert {n: plan.get(n) for n in KEEP} == {"torch": "2.13.0", "megatron-core": "0.16.1"}, plan


def test_pinned_sets_satisfy_the_package_metadata(wheelhouse):
    """requirements.txt and requirements-mlm.txt (what `make` installs) lie inside the ranges setup.py states."""
    wheel = next(wheelhouse.glob("megatron_spindle-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
    assert {canonicalize_name(r.name) for r in requires} >= {"numpy", *KEEP}
    outside = []
    for pinned in (ROOT / "requirements.txt", ROOT / "requirements-mlm.txt"):
        for name, version in pins(pinned).items():
            for r in requires:
                if canonicalize_name(r.name) == name and not r.specifier.contains(version, prereleases=True):
                    outside.append(f"{pinned.name}: {name}=={version} outside {r}")
    assert outside == []
