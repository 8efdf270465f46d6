"""The performance figures in the docs come from benchmarks/results/: every ``<!-- results: NAME -->`` line of
a page names a results file that renders with its command, machine and date; benchmarks/results/ holds only
the curated files the pages cite (every other run lives in benchmarks/experiments/, which the site does not
publish); the benchmark scripts write the one shape the docs read; and no page carries a hand-typed table of
measurements."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: a number as pages write measurements: thousands spaced, maybe a unit
NUMBER = r"~?\d[\d ,]*(?:\.\d+)?(?:\s*(?:×|x|s|ms|µs|%|MiB|GiB|GB|GB/s|tok/s|tokens/s))?"
#: a table cell that is only measurements: one number, or several joined as a change or a series
#: (``378 → 284``, ``25.1 / 128.7``, ``2 160–2 250``), maybe bold, maybe with a remark in brackets
MEASUREMENT = re.compile(rf"^\**{NUMBER}(?:\s*(?:→|->|/|–|-|to|vs)\s*{NUMBER})*\**(?:\s*\(.*\))?$")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _gen_docs()


def markers() -> list:
    return [pytest.param(page, match.group(1), id=f"{page.relative_to(ROOT)}:{match.group(1)}")
            for page in PAGES for match in gen_docs.MARKER.finditer(page.read_text())]


def cited() -> set[Path]:
    return {gen_docs.results_file(param.values[1]) for param in markers()}


@pytest.mark.parametrize(("page", "name"), markers())
def test_marker_renders_with_command_machine_and_date(page: Path, name: str) -> None:
    data = json.loads(gen_docs.results_file(name).read_text())
    block = gen_docs.results_block(name)
    assert data["command"].split()[-1] in block and data["date"][:10] in block
    assert gen_docs._cell(data["machine"]) in block
    assert "\n|---|" in block, f"{page.name}: <!-- results: {name} --> rendered no table"


def test_some_pages_have_markers() -> None:
    assert markers(), "no '<!-- results: NAME -->' line in docs/"


@pytest.mark.parametrize("path", sorted(gen_docs.RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_curated_file_has_the_shape_and_is_cited(path: Path) -> None:
    gen_docs.read_results(path)
    assert path in cited(), f"{path.name} is in benchmarks/results/ but no page cites it (or a newer file of " \
                            "its name is shown): cite it with '<!-- results: NAME -->' or move it to " \
                            "benchmarks/experiments/"


def test_the_results_page_shows_only_curated_files() -> None:
    page = gen_docs.performance_page()
    shown = set(re.findall(r"Generated from `benchmarks/(\w+)/([\w.-]+)`", page))
    assert shown == {("results", p.name) for p in gen_docs.RESULTS.glob("*.json")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_hand_typed_measurements(page: Path) -> None:
    rows = [line for line in page.read_text().splitlines()
            if line.startswith("|") and not line.startswith("|---")
            and any(MEASUREMENT.match(cell.strip()) for cell in line.strip("|").split("|"))]
    assert not rows, f"{page.relative_to(ROOT)} has hand-typed measurements; write them as JSON in " \
                     f"benchmarks/results/ and use '<!-- results: NAME -->':\n" + "\n".join(rows)


@pytest.mark.parametrize("cell", ["378 → 284", "25.1 / 128.7", "**1.52/1.64×**", "0.90× / 0.95×", "2 160–2 250",
                                  "6 990", "12 ms (p50)"])
def test_the_guard_sees_changes_and_series(cell: str) -> None:
    assert MEASUREMENT.match(cell)


@pytest.mark.parametrize("cell", ["v1.0.0", "1.2.1", "tp 1", "`--tp 2`", "float16"])
def test_the_guard_leaves_other_cells(cell: str) -> None:
    assert not MEASUREMENT.match(cell)


def test_a_missing_results_file_fails_the_build(tmp_path: Path) -> None:
    with pytest.raises(gen_docs.ResultsError, match="no benchmarks/results/nothing"):
        gen_docs.fill_results("text\n<!-- results: nothing -->\n", results=tmp_path, where="page.md")


def test_a_file_of_another_shape_fails_with_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "demo-2030-01-02.json").write_text(json.dumps({"title": "x", "shapes": {}}))
    with pytest.raises(gen_docs.ResultsError, match=r"demo-2030-01-02.json: missing .*command \(str\)"):
        gen_docs.fill_results("<!-- results: demo -->\n", results=tmp_path, where="page.md")


def test_written_results_render_with_caption(tmp_path: Path) -> None:
    out = gen_docs.write_results("demo", title="Demo", columns=["setup", "req/s"], rows=[["a", 1.5], ["b", 3]],
                                 machine_line=gen_docs.machine("otherwise idle", (0.5, 0.25, 0.0)),
                                 command="python benchmarks/demo.py --fast", notes="b is 2× a.",
                                 out=tmp_path / "demo-2030-01-02.json")
    data = json.loads(out.read_text())
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"])
    assert "cores, otherwise idle, load average 0.50 / 0.25 / 0.00 at start" in data["machine"]
    text = gen_docs.fill_results("before\n<!-- results: demo -->\nafter\n", results=tmp_path)
    assert "`python benchmarks/demo.py --fast`" in text and data["date"] in text and data["machine"] in text
    assert "| setup | req/s |\n|---|---|\n| a | 1.5 |\n| b | 3 |" in text and "b is 2× a." in text
    assert text.startswith("before\n") and text.endswith("after\n")


def test_runs_are_written_to_experiments_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gen_docs.EXPERIMENTS == ROOT / "benchmarks" / "experiments"
    monkeypatch.setattr(gen_docs, "EXPERIMENTS", tmp_path / "experiments")
    out = gen_docs.write_results("demo", title="Demo", columns=["a"], rows=[[1]], machine_line="m", command="c")
    assert out.parent == tmp_path / "experiments" and gen_docs.read_results(out)["rows"] == [[1]]


def test_the_newest_dated_file_is_shown(tmp_path: Path) -> None:
    for date in ("2030-01-02", "2031-05-06", "2029-12-31"):
        (tmp_path / f"demo-{date}.json").write_text("{}")
    (tmp_path / "demo_other-2040-01-01.json").write_text("{}")
    (tmp_path / "demo-process-2041-01-01.json").write_text("{}")
    assert gen_docs.results_file("demo", tmp_path).name == "demo-2031-05-06.json"


def test_a_curated_file_of_another_shape_fails_the_site_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exceptions = pytest.importorskip("mkdocs.exceptions")
    (tmp_path / "old-2030-01-02.json").write_text(json.dumps({"gpu": "H100", "shapes": {}}))
    monkeypatch.setattr(gen_docs, "RESULTS", tmp_path)
    with pytest.raises(exceptions.PluginError, match="old-2030-01-02.json: missing"):
        gen_docs.on_files([], None)
