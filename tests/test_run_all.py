"""``scripts/bench/run_all.py`` writes every table row the README's prose cites, and a report
that lacks one fails.

The README states no benchmark figure of its own: where its prose speaks of a cost it names
rows of the tables run_all writes between the perf markers (``run_all.CITED``: a table's
heading, its rows' first cells), as ``"label"``. These tests render the tables of a saved
run (``tests/data/run_all/results.json``, the results of a real ``run_all.py --quick``, its
stderr left out; the steps entry from a later ``--only steps --quick``, once bench_steps.py
measured the transport alone; the tools entry from ``bench_tools.py --runs 1 --json`` run as
run_all runs it, over a mount of its tree, once it had the bwrap-binds row) with ``run_all.py --from-results`` into a copy of
the README, measuring nothing, and check that every cited row is in it, that the prose
names every cited row, and that a run whose results lack a cited row exits 1 naming it;
and that no paragraph of the README that speaks of the benchmarks states a measured figure
(only goals and intervals), which would come from a separate run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN_ALL = REPO / "scripts" / "bench" / "run_all.py"
RESULTS = Path(__file__).resolve().parent / "data" / "run_all" / "results.json"


def run_all_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_all", RUN_ALL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run_all() -> ModuleType:
    return run_all_module()


def split_readme(text: str, mod: ModuleType) -> tuple[str, str]:
    """(the README without its perf block, the block)."""
    head, rest = text.split(mod.BEGIN, 1)
    block, tail = rest.split(mod.END, 1)
    return head + tail, block


def render(tmp: Path, results: dict[str, Any]) -> tuple[subprocess.CompletedProcess[str], str]:
    """``run_all.py --from-results`` of ``results`` into a copy of the README; the process
    and the copy's text afterwards."""
    (tmp / "results.json").write_text(json.dumps(results))
    readme = tmp / "README.md"
    readme.write_text((REPO / "README.md").read_text())
    p = subprocess.run([sys.executable, str(RUN_ALL), "--from-results",
                        str(tmp / "results.json"), "--doc", str(tmp / "performance.md"),
                        "--readme", str(readme)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    return p, readme.read_text()


def test_the_prose_names_every_cited_row_and_its_table(run_all: ModuleType) -> None:
    prose, _ = split_readme((REPO / "README.md").read_text(), run_all)
    flat = " ".join(prose.split())       # a label may be wrapped over two lines
    assert run_all.CITED
    for heading, (_bench, labels) in run_all.CITED.items():
        assert f'table "{heading}"' in flat, heading
        for label in labels:
            assert f'"{label}"' in flat, (heading, label)


def test_a_run_writes_every_cited_row(run_all: ModuleType, tmp_path: Path) -> None:
    results = json.loads(RESULTS.read_text())
    ran = {r["name"] for r in results["results"] if r["status"] == "ok"}
    assert {bench for bench, _ in run_all.CITED.values()} <= ran
    p, text = render(tmp_path, results)
    assert p.returncode == 0, p.stderr
    prose, block = split_readme(text, run_all)
    assert prose == split_readme((REPO / "README.md").read_text(), run_all)[0]
    rows = run_all.table_rows(block)
    for heading, (_bench, labels) in run_all.CITED.items():
        assert heading in rows, heading
        for label in labels:
            assert label in rows[heading], (heading, label, sorted(rows[heading]))
    assert block.strip() in (tmp_path / "performance.md").read_text()


def test_a_report_without_a_cited_row_fails_naming_it(run_all: ModuleType,
                                                      tmp_path: Path) -> None:
    results = json.loads(RESULTS.read_text())
    by_name = {r["name"]: r for r in results["results"]}
    tools = by_name["tools"]["data"]
    tools["rows"] = [r for r in tools["rows"] if "hidden" not in r["workload"]]
    by_name["exclude"]["data"] = by_name["exclude"]["data"][:1]    # 20,000 kept: missing
    p, text = render(tmp_path, results)
    assert p.returncode == 1, p.stdout[-2000:]
    assert '"Bash true, 100 hidden + 100 protected" (Agent tools)' in p.stderr, p.stderr
    assert '"20,000 files kept" (Excluded paths)' in p.stderr, p.stderr
    assert '"5,000 files kept"' not in p.stderr
    _, block = split_readme(text, run_all)
    assert "20,000 files kept" not in block



def test_figures_that_do_not_fit_their_table_fail_the_run(run_all: ModuleType,
                                                          tmp_path: Path) -> None:
    results = json.loads(RESULTS.read_text())
    steps = next(r for r in results["results"] if r["name"] == "steps")
    del steps["data"]["step_daemon_ms"]      # a key the benchmark no longer writes
    exclude = next(r for r in results["results"] if r["name"] == "exclude")
    exclude["data"] = []                     # output run_all's parser no longer reads
    p, text = render(tmp_path, results)
    assert p.returncode == 1, p.stdout[-2000:]
    assert "figures that do not fit their table: steps" in p.stderr, p.stderr
    assert '"a step, round trip" (Step change log)' in p.stderr, p.stderr
    _, block = split_readme(text, run_all)
    assert "the steps benchmark's figures do not fit this table (KeyError" in block
    assert "#### Sparse files" in block             # the sections after it are written
    assert "the exclude benchmark gave no figures this report reads" in block
    assert '"20,000 files kept" (Excluded paths)' in p.stderr, p.stderr

def test_a_cited_row_of_a_benchmark_that_did_not_run_is_not_reported(
        run_all: ModuleType, tmp_path: Path) -> None:
    results = json.loads(RESULTS.read_text())
    for r in results["results"]:
        if r["name"] == "exclude":
            r.update(status="not run", data=None, stdout="")
    p, text = render(tmp_path, results)
    assert p.returncode == 0, p.stderr
    assert "Excluded paths" not in p.stderr
    _, block = split_readme(text, run_all)
    assert "_Not available: the exclude benchmark: not run._" in block


FIGURE = re.compile(r"(?<![\w.])\d[\d,.]*(?: ?(?:ms|µs|s|MiB/s|MB/s|GiB/s|minutes?)\b|x\b)")
NOT_MEASURED = {"50 ms", "150 ms", "100 MiB/s", "1.15x", "2x", "20 minutes", "5 minutes"}
"""Figures the benchmark paragraphs may state: intervals, goals, run_all's budget and the
build time of its big tree."""


def test_the_paragraphs_on_benchmarks_state_no_measured_figure(run_all: ModuleType) -> None:
    prose, _ = split_readme((REPO / "README.md").read_text(), run_all)
    prose = re.sub(r"^```.*?^```", "", prose, flags=re.M | re.S)
    paragraphs = re.split(r"\n\s*\n|\n(?=- )", prose)
    about = [p for p in paragraphs if re.search(r"bench_|run_all|\(#performance\)", p)]
    assert len(about) >= 6, "the paragraphs that speak of the benchmarks"
    for p in about:
        stated = set(FIGURE.findall(p)) - NOT_MEASURED
        assert not stated, (f"{sorted(stated)}: a figure of a separate run; cite the row of "
                            f"run_all's table instead (run_all.CITED): {' '.join(p.split())}")


POSITIONAL = re.compile(r"\bthe rows? (?:after|before|above|below)\b"
                        r"|\bthe (?:next|previous|last|first) row\b")


def test_every_row_the_prose_names_is_cited(run_all: ModuleType, tmp_path: Path) -> None:
    """A row of run_all's tables that the prose names (as "label") is in ``CITED``, so a
    run that lacks it fails; and the prose never points at a row by its place ("the row
    after it"), which no check can follow."""
    p, text = render(tmp_path, json.loads(RESULTS.read_text()))
    assert p.returncode == 0, p.stderr
    prose, block = split_readme(text, run_all)
    prose = re.sub(r"^```.*?^```", "", prose, flags=re.M | re.S)
    flat = re.sub(r"`[^`]*`", "", " ".join(prose.split()))     # code spans quote too
    every_row = set().union(*run_all.table_rows(block).values())
    named = {q for q in re.findall(r'"([^"]+)"', flat) if q in every_row}
    cited = {label for _, labels in run_all.CITED.values() for label in labels}
    assert named, "the prose names rows of the tables"
    assert named <= cited, sorted(named - cited)
    assert not POSITIONAL.search(flat), POSITIONAL.search(flat)
