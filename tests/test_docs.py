"""What README.md and docs/ promise, checked against the repository.

* README stays a user's page (about 300 lines at most); the rest lives in docs/.
* Every relative link in README.md and docs/*.md names a file that exists.
* Every flag in README's flags table is a flag the training entry points accept (``build_parser``).
* Every script or example the README names exists.
* The README's results table and docs/compare.md's are rows that ``scripts/bench_paper.py`` wrote into
  ``docs/results/compare_readme_section.md`` (the same run as ``paper_grid.json``, which
  ``tests/test_paper_grid.py`` checks against the planner), so no hand-edited number can stand there.
"""
import re
from pathlib import Path

from megatron_spindle.megatron.adapter.flags import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
GENERATED = ROOT / "docs" / "results" / "compare_readme_section.md"


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail into docs/"


def test_every_relative_link_resolves():
    missing = []
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_flags_table_names_real_flags():
    options = {s for action in build_parser()._actions for s in action.option_strings}
    rows = table_rows(section(README.read_text(), "Flags"))
    flags = [f for row in rows[1:] for f in re.findall(r"`(--[a-z0-9-]+)", row.split("|")[1])]
    assert len(flags) >= 15, flags
    assert [f for f in flags if f not in options] == []


def test_named_scripts_exist():
    named = set(re.findall(r"((?:scripts|examples)/[\w./-]+\.(?:sh|py|toml))", README.read_text()))
    assert named, "README names no script"
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def test_results_live_in_one_place():
    """The race's table is docs/compare.md's, written by scripts/bench_paper.py; README links it and copies no
    row of it, and each speedup README quotes for a workload on some GPUs is that row's."""
    generated = table_rows(GENERATED.read_text())
    compare = table_rows((ROOT / "docs" / "compare.md").read_text())
    assert set(generated) <= set(compare), sorted(set(generated) - set(compare))
    results = section(README.read_text(), "Results")
    assert "docs/compare.md" in results
    assert [r for r in table_rows(results) if re.match(r"\| (Multitask-CLIP|OFASys|Qwen-VAL)-\d+", r)] == []
    rows = {tuple(c.strip() for c in r.split("|")[1:3]): r for r in compare if re.match(r"\| \S+-\d+ \| \d+ \|", r)}
    quoted = re.findall(r"(\d\.\d\dx) on ((?:Multitask-CLIP|OFASys|Qwen-VAL)-\d+) / (\d+)", " ".join(results.split()))
    assert len(quoted) >= 3, quoted
    assert [q for q in quoted if q[0] not in rows.get((q[1], q[2]), "")] == []
