"""The performance figures in the docs come from benchmarks/results/: every ``<!-- results: NAME -->`` line of
a page names a results file that renders with its command, machine and date, the benchmark scripts write
the shape the docs read, and no page carries a hand-typed table of measurements."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: pages whose hand-typed table still waits to become a marker
PENDING: set[str] = set()
#: a table cell that is only a measurement: a number, maybe bold, maybe with a unit or a ratio sign
MEASUREMENT = re.compile(r"^\**[0-9][0-9 .,]*(?:\s*(?:×|x|s|ms|%|MiB|GB|GB/s))?\**(?:\s*\(.*\))?$")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _gen_docs()


def markers() -> list:
    return [pytest.param(page, match.group(1), id=f"{page.relative_to(ROOT)}:{match.group(1)}")
            for page in PAGES for match in gen_docs.MARKER.finditer(page.read_text())]


@pytest.mark.parametrize(("page", "name"), markers())
def test_marker_renders_with_command_machine_and_date(page: Path, name: str) -> None:
    data = json.loads(gen_docs.results_file(name).read_text())
    block = gen_docs.results_block(name)
    assert data["command"].split()[-1] in block and data["date"][:10] in block
    assert gen_docs._cell(gen_docs._machine(data)) in block  # a line, or a dict the caption writes as one
    assert "\n|---|" in block, f"{page.name}: <!-- results: {name} --> rendered no table"


def test_some_pages_have_markers() -> None:
    assert markers(), "no '<!-- results: NAME -->' line in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_hand_typed_measurements(page: Path) -> None:
    rel = str(page.relative_to(ROOT))
    rows = [line for line in page.read_text().splitlines()
            if line.startswith("|") and not line.startswith("|---")
            and any(MEASUREMENT.match(cell.strip()) for cell in line.strip("|").split("|"))]
    if rel in PENDING:
        pytest.xfail(f"{rel}: its table is not generated yet")
    assert not rows, f"{rel} has hand-typed measurements; write them as JSON in benchmarks/results/ and use " \
                     f"'<!-- results: NAME -->':\n" + "\n".join(rows)


def test_a_missing_results_file_fails_the_build(tmp_path: Path) -> None:
    with pytest.raises(gen_docs.ResultsError, match="no benchmarks/results/nothing"):
        gen_docs.fill_results("text\n<!-- results: nothing -->\n", results=tmp_path, where="page.md")


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


def test_the_newest_dated_file_is_shown(tmp_path: Path) -> None:
    for date in ("2030-01-02", "2031-05-06", "2029-12-31"):
        (tmp_path / f"demo-{date}.json").write_text("{}")
    (tmp_path / "demo_other-2040-01-01.json").write_text("{}")
    assert gen_docs.results_file("demo", tmp_path).name == "demo-2031-05-06.json"
