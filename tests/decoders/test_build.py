"""Whole ``forge build`` runs of a tiny GPT-2: real export, an engine double instead of trtllm-build."""

from __future__ import annotations

import pytest

import engine_double
from forge import hookimpl
from forge import tritonconfig as tc
from forge.cli import main
from forge.components import Artifact
from forge import profiles
from forge.llm.interface import tensorrt_llm_io
from forge.testing import use_plugins
from forge.checks import validate_repository


class EngineDoublePlugin:
    """Test-only plugin: replaces trtllm-build (the compile stage) by writing an engine double."""

    @hookimpl(tryfirst=True)
    def forge_compile(self, component, artifact, ctx):
        if component.family != "gpt" or ctx.target != "tensorrtllm":
            return None
        meta = dict(artifact.meta)
        engine = engine_double.write_engine_dir(ctx.workdir / "engine", tp=ctx.spec.tp, pp=ctx.spec.pp,
                                                vocab_size=meta.get("vocab_size_padded", meta["vocab_size"]))
        return Artifact("trtllm-engine", engine, meta)


@pytest.fixture
def plugins():
    with use_plugins(("engine-double", EngineDoublePlugin()), entry_points=True) as registry:
        yield registry


@pytest.mark.parametrize("version", ["v0.9.0", "v0.13.0", "v1.2.1"])
def test_build_tensorrtllm_target(version, tiny_gpt2, plugins, tmp_path):
    out = tmp_path / "repo"
    argv = ["build", "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out), "--max-input-len", "64",
            "--max-seq-len", "128"]
    if version:
        argv += ["--backend-version", version]
    assert main(argv) == 0
    assert validate_repository(out) == []
    assert main(["validate", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == \
        ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
    llm = tc.read(out / "tensorrt_llm")
    assert llm.backend == "tensorrtllm"
    assert tc.parameter(llm, "gpt_model_path") == str((out / "tensorrt_llm" / "1").resolve())
    assert (out / "tensorrt_llm" / "1" / "rank0.engine").read_bytes() == engine_double.FAKE_ENGINE_BYTES
    profile = profiles.resolve(version)
    ensemble = tc.read(out / "ensemble")
    assert {t.name for t in ensemble.input} == {feed for feed, _, _ in profiles.routes(
        profile, include=lambda model, t: not t.multimodal).feeds}


def test_build_with_bls_decoupled_and_tensor_parallel(tiny_gpt2, plugins, tmp_path):
    out = tmp_path / "repo"
    assert main(["build", "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out), "--tp", "2",
                 "--backend-version", "v1.2.1",
                 "--max-input-len", "64", "--max-seq-len", "128", "--decoupled", "-o", "bls=true",
                 "-o", "kv_cache_free_gpu_mem_fraction=0.5", "--instances", "2"]) == 0
    assert validate_repository(out) == []
    bls = tc.read(out / "tensorrt_llm_bls")
    assert bls.model_transaction_policy.decoupled and tc.read(out / "tensorrt_llm").model_transaction_policy.decoupled
    assert bls.instance_group[0].count == 2
    assert tc.parameter(tc.read(out / "tensorrt_llm"), "kv_cache_free_gpu_mem_fraction") == "0.5"
    assert sorted(p.name for p in (out / "tensorrt_llm" / "1").iterdir()) == ["config.json", "rank0.engine",
                                                                              "rank1.engine"]


def test_bad_option_fails_the_build_with_a_usage_error(tiny_gpt2, plugins, tmp_path, capsys):
    """Bad input: an option of another backend version stops the build with exit code 2."""
    out = tmp_path / "repo"
    code = main(["build", "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out),
                 "--backend-version", "v1.0.0",
                 "--max-input-len", "64", "--max-seq-len", "128", "-o", "enable_trt_overlap=true"])
    assert code == 2
    assert "enable_trt_overlap is not a parameter of tensorrtllm_backend v1.0.0" in capsys.readouterr().err
    assert not out.exists()


def test_build_python_target_has_the_same_interface(tiny_gpt2, plugins, tmp_path):
    out = tmp_path / "repo"
    assert main(["build", "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out), "--target", "python",
                 "--dtype", "float32", "--max-input-len", "64", "--max-seq-len", "128",
                 "--backend-version", "v0.13.0"]) == 0
    assert validate_repository(out) == []
    llm = tc.read(out / "tensorrt_llm")
    assert llm.backend == "python"
    from forge.spec import BuildSpec

    spec = BuildSpec(families=["gpt"], model=tiny_gpt2, out=out, dtype="float32", backend_version="v0.13.0")
    inputs, outputs = tensorrt_llm_io(profiles.resolve("v0.13.0"), spec)
    assert list(llm.input) == inputs and list(llm.output) == outputs


def test_backends_before_trtllm_build_are_refused_for_engines_and_record_no_command(tiny_gpt2, tmp_path, capsys):
    """v0.5.0 (seed 000) predates trtllm-build: no engine build, no command that did not exist then."""
    argv = ["build", "--family", "gpt", "--model", str(tiny_gpt2), "--backend-version", "v0.5.0"]
    assert main(argv + ["--out", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err
    assert "tensorrtllm_backend v0.5.0 goes with TensorRT-LLM 0.5.0, which predates trtllm-build" in err
    assert not (tmp_path / "repo").exists()
    assert main(argv + ["--out", str(tmp_path / "plan"), "--dry-run"]) == 0
    assert "trtllm-build" not in capsys.readouterr().out
