"""Code that runs inside tritonserver has one home, imports nothing of forge, and ships its glue."""

from __future__ import annotations

import ast
from pathlib import Path

import forge
from forge import in_triton as served

SERVED = Path(served.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_served_code_imports_nothing_of_forge():
    files = sorted(SERVED.rglob("*.py"))
    assert len(files) >= 12
    for path in files:
        bad = {n for n in _imports(path) if n == "forge" or n.startswith("forge_") and n not in
               ("forge_glue", "forge_text", "forge_decoder", "forge_store", "forge_image",
                "forge_onnx", "forge_llmapi", "forge_vllm_wire", "forge_vllm_metrics")}  # shipped beside model.py
        assert not bad, f"{path.relative_to(SERVED)} imports {sorted(bad)}"


def test_no_served_code_outside_its_home():
    """Every file that defines a TritonPythonModel lives under forge/served."""
    root = Path(forge.__file__).resolve().parent
    outside = [p for p in root.rglob("*.py") if SERVED not in p.parents and "class TritonPythonModel" in p.read_text()]
    assert outside == []


def test_every_python_model_ships_the_glue():
    from forge.llm.pytarget import runtime_files

    assert "1/forge_glue.py" in runtime_files()
    assert served.glue_files() == {"1/forge_glue.py": served.GLUE.read_bytes()}


def test_responses_hold_only_requested_outputs():
    """The tritonserver 2.51 + Python 3.12 crash (unrequested outputs freed without the GIL) cannot happen."""
    import numpy as np

    from forge.in_triton import forge_glue

    class Tensor:
        def __init__(self, name, value):
            self._name, self.value = name, value

        def name(self):
            return self._name

    forge_glue.pb_utils = type("Utils", (), {"Tensor": Tensor})
    try:
        outputs = {"output_ids": np.zeros((1, 1, 2)), "cum_log_probs": np.zeros((1, 1))}
        assert [t.name() for t in forge_glue.select(outputs, {"output_ids"})] == ["output_ids"]
        assert [t.name() for t in forge_glue.select(outputs, None)] == ["output_ids", "cum_log_probs"]
    finally:
        forge_glue.pb_utils = None
