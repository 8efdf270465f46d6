"""Exports checked by TensorRT-LLM's own checkpoint loader (``../shared/trtllm-check``, TensorRT-LLM
0.16.0.dev2024121000 source, strict mode): what ``trtllm-build`` loads before it builds anything.

Accepted by that loader ≠ an engine was built: names, shapes, dtypes and layer placement only.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from llama_models import make_llama

from forge.cli import main

CHECK = Path(__file__).resolve().parents[2].parent / "shared" / "trtllm-check"
TARBALL = CHECK / "trtllm-src-0.16.0.dev2024121000.tar.gz"

pytestmark = pytest.mark.skipif(not TARBALL.is_file(), reason=f"{CHECK} is absent (TensorRT-LLM checker not installed)")


@pytest.fixture(scope="module")
def trtllm_src(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("trtllm-src")
    with tarfile.open(TARBALL) as tar:
        tar.extractall(src, filter="data")
    return src


def checked(src: Path, *dirs: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK / "check_ckpt.py"), "--src", str(src), *map(str, dirs)],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args", [
    ("--dtype", "float16"),
    ("--dtype", "bfloat16", "--tp", "2"),
    ("--dtype", "float32", "--pp", "2", "--backend-version", "v0.16.0"),  # 4 layers: an even split
    ("--dtype", "float16", "--tp", "2", "--pp", "2", "--backend-version", "v0.16.0"),
])
def test_llama_exports_pass_the_strict_loader(args, trtllm_src, tmp_path):
    model = make_llama(tmp_path / "m", layers=4)
    out = tmp_path / "ckpt"
    assert main(["export", "--family", "llama", "--model", str(model), "--out", str(out), *args]) == 0
    result = checked(trtllm_src, out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("OK:") == 1 and "FAIL" not in result.stdout


def test_uneven_split_that_the_loader_would_truncate_is_refused(trtllm_src, tmp_path, capsys):
    """Regression (issue 14): 3 layers at --pp 2 for 0.16 — forge refuses instead of writing [0,1] | [2]."""
    model = make_llama(tmp_path / "m", layers=3)
    out = tmp_path / "ckpt"
    assert main(["export", "--family", "llama", "--model", str(model), "--out", str(out), "--pp", "2",
                 "--backend-version", "v0.16.0"]) == 2
    assert "cannot be split evenly over --pp 2" in capsys.readouterr().err
    assert not out.exists()
