"""compile for --target tensorrtllm: the trtllm-build command per backend version, the engine artifact,
and what happens without TensorRT-LLM."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import forge_gpt
from forge.cli import main
from forge.components import Artifact
from forge.context import BuildContext, StageRecord
from forge.errors import ForgeError, UsageError
from forge.llm import checkpoint, trtllm_build as engine
from forge.spec import BuildSpec, Limits

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

FAKE_TRTLLM_BUILD = """#!{python}
# Stands in for trtllm-build: records its argv and writes what the real tool writes.
import json, sys
from pathlib import Path

args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
ckpt, out = Path(opt("--checkpoint_dir")), Path(opt("--output_dir"))
world = json.loads((ckpt / "config.json").read_text())["mapping"]["world_size"]
Path("argv.json").write_text(json.dumps(sys.argv))
out.mkdir(parents=True, exist_ok=True)
if "{mode}" != "empty":
    (out / "config.json").write_text(json.dumps({{"version": "0.0.fake", "pretrained_config": {{}}}}))
    for r in range(world):
        (out / f"rank{{r}}.engine").write_bytes(b"engine")
"""


def spec_for(model: Path, **kw) -> BuildSpec:
    kw.setdefault("limits", Limits(max_batch_size=4, max_input_len=100, max_seq_len=300))
    return BuildSpec(families=["gpt"], model=model, out=Path("unused"), **kw)


def ctx_for(spec: BuildSpec, workdir: Path) -> BuildContext:
    workdir.mkdir(parents=True, exist_ok=True)
    return BuildContext(spec=spec, target="tensorrtllm", workdir=workdir, record=StageRecord("compile", ""))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


META = {"dtype": "float16", "world_size": 1, "quant": {}}


def test_newest_flag_set(tmp_path):
    """No --backend-version: max_seq_len, kv_cache_type paged, plugins in the model dtype, FMHA, profiles."""
    argv = engine.build_command(Path("/ckpt"), Path("engine"), META, spec_for(tmp_path), {})
    assert argv[0] == "trtllm-build"
    assert flag(argv, "--checkpoint_dir") == "/ckpt" and flag(argv, "--output_dir") == "engine"
    limits = (flag(argv, "--max_batch_size"), flag(argv, "--max_input_len"), flag(argv, "--max_seq_len"))
    assert limits == ("4", "100", "300")
    assert "--max_output_len" not in argv and "--paged_kv_cache" not in argv
    assert flag(argv, "--kv_cache_type") == "paged"
    assert flag(argv, "--gpt_attention_plugin") == flag(argv, "--gemm_plugin") == "float16"
    for name in ("--remove_input_padding", "--context_fmha", "--use_paged_context_fmha", "--multiple_profiles"):
        assert flag(argv, name) == "enable", name
    assert "--workers" not in argv and "--max_num_tokens" not in argv


@pytest.mark.parametrize("version,seq,output,paged,profiles", [
    ("v0.5.0", None, "200", "enable", None),
    ("v0.10.0", None, "200", "enable", None),
    ("v0.13.0", "300", None, "enable", "enable"),
    ("v1.0.0", "300", None, None, "enable"),
])
def test_flags_follow_the_backend_version(tmp_path, version, seq, output, paged, profiles):
    """Before 0.11 the generated length is --max_output_len = max_seq_len − max_input_len."""
    argv = engine.build_command(Path("/c"), Path("e"), META, spec_for(tmp_path, backend_version=version), {})
    assert flag(argv, "--max_seq_len") == seq
    assert flag(argv, "--max_output_len") == output
    assert flag(argv, "--paged_kv_cache") == paged
    assert flag(argv, "--multiple_profiles") == profiles
    assert (flag(argv, "--kv_cache_type") == "paged") == (paged is None)


def test_options_dtype_and_quant_shape_the_command(tmp_path):
    """float32 turns fused MHA off; FP8 leaves GEMMs to TensorRT; workers default to the world size."""
    spec = spec_for(tmp_path, limits=Limits(max_num_tokens=4096, max_beam_width=2))
    argv = engine.build_command(Path("/c"), Path("e"), {"dtype": "float32", "world_size": 4, "quant": {}}, spec, {})
    assert flag(argv, "--context_fmha") == flag(argv, "--use_paged_context_fmha") == "disable"
    assert flag(argv, "--workers") == "4"
    assert flag(argv, "--max_num_tokens") == "4096" and flag(argv, "--max_beam_width") == "2"
    fp8 = {"dtype": "bfloat16", "world_size": 2, "quant": {"quant_algo": "FP8"}}
    argv = engine.build_command(Path("/c"), Path("e"), fp8, spec, {"workers": 1, "multiple_profiles": False,
                                                                      "trtllm_build_args": "--log_level verbose"})
    assert "--gemm_plugin" not in argv and flag(argv, "--gpt_attention_plugin") == "bfloat16"
    assert "--workers" not in argv and flag(argv, "--multiple_profiles") == "disable"
    assert argv[-2:] == ["--log_level", "verbose"]


def test_limits_stay_within_the_position_table(tmp_path):
    """A 32-position model, 100 of 300 asked: max_seq_len is cut to 32 and the prompt keeps its third (10)."""
    meta = {**META, "max_position_embeddings": 32}
    argv = engine.build_command(Path("/c"), Path("e"), meta, spec_for(tmp_path), {})
    assert (flag(argv, "--max_input_len"), flag(argv, "--max_seq_len")) == ("10", "32")
    old = engine.build_command(Path("/c"), Path("e"), meta, spec_for(tmp_path, backend_version="v0.9.0"), {})
    assert flag(old, "--max_output_len") == "22"


def test_clamped_limits_leave_room_to_generate(tmp_path):
    """Regression (issue 14): a 128-position model with the default limits recorded 127 + 1 output token."""
    spec = spec_for(tmp_path, limits=Limits())  # the CLI defaults: 1024 of 2048
    meta = {**META, "max_position_embeddings": 128}
    argv = engine.build_command(Path("/c"), Path("e"), meta, spec, {})
    assert (flag(argv, "--max_input_len"), flag(argv, "--max_seq_len")) == ("64", "128")
    clamped = engine.clamped_limits(spec, meta)
    assert clamped["requested"] == {"max_input_len": 1024, "max_seq_len": 2048}
    assert clamped["used"] == {"max_input_len": 64, "max_seq_len": 128} and "64 tokens to generate" in clamped["why"]
    fits = spec_for(tmp_path, limits=Limits(max_input_len=100, max_seq_len=128))  # asked within the table
    assert engine.sequence_limits(fits, meta) == (100, 128) and engine.clamped_limits(fits, meta) is None
    assert engine.sequence_limits(spec_for(tmp_path, limits=Limits(max_input_len=100, max_seq_len=200)),
                                  meta) == (100, 128)  # the prompt still fits: only the sequence is cut


def test_unreadable_backend_version(tmp_path):
    """Bad input: --backend-version that is not a version."""
    with pytest.raises(UsageError, match="write it like v0.13.0"):
        engine.build_command(Path("/c"), Path("e"), META, spec_for(tmp_path, backend_version="latest-ish"), {})


@pytest.fixture
def exported(tiny_gpt2, tmp_path) -> Artifact:
    spec = spec_for(tiny_gpt2, tp=2)
    return checkpoint.export(forge_gpt.ADAPTER, tiny_gpt2, ctx_for(spec, tmp_path / "export"))


def install_fake(tmp_path, monkeypatch, mode: str = "ok") -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "trtllm-build"
    tool.write_text(FAKE_TRTLLM_BUILD.format(python=sys.executable, mode=mode))
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_engine_artifact_from_trtllm_build(exported, tiny_gpt2, tmp_path, monkeypatch):
    """trtllm-build runs in the work directory; the engine artifact carries the checkpoint meta through."""
    install_fake(tmp_path, monkeypatch)
    spec = spec_for(tiny_gpt2, tp=2, backend_version="v0.13.0")
    ctx = ctx_for(spec, tmp_path / "compile")
    built = engine.compile(exported, ctx)
    assert built.kind == "trtllm-engine" and built.path == ctx.workdir / "engine"
    assert sorted(p.name for p in built.path.iterdir()) == ["config.json", "rank0.engine", "rank1.engine"]
    for key in ("architecture", "dtype", "tp", "pp", "world_size", "vocab_size", "num_kv_heads", "quant"):
        assert built.meta[key] == exported.meta[key]
    assert built.meta["engine"]["max_seq_len"] == 32 and built.meta["engine"]["max_input_len"] == 10  # 32 positions
    assert built.meta["engine"]["trtllm_version"] == "0.0.fake"
    assert "32 positions" in ctx.record.notes["limits"]["why"]
    argv = json.loads((ctx.workdir / "argv.json").read_text())
    assert argv[1:] == ctx.record.commands[0][1:]  # the recorded command is the one that ran
    assert flag(argv, "--checkpoint_dir") == str(exported.path) and flag(argv, "--workers") == "2"
    assert ctx.record.notes["engine"]["files"] == ["config.json", "rank0.engine", "rank1.engine"]


def test_no_engine_claimed_when_none_was_written(exported, tiny_gpt2, tmp_path, monkeypatch):
    """trtllm-build exits 0 but writes no engines: the stage fails instead of returning an artifact."""
    install_fake(tmp_path, monkeypatch, mode="empty")
    ctx = ctx_for(spec_for(tiny_gpt2, tp=2), tmp_path / "compile")
    with pytest.raises(ForgeError, match="lacks config.json, rank0.engine, rank1.engine"):
        engine.compile(exported, ctx)


def test_dry_run_records_the_command_and_builds_nothing(exported, tiny_gpt2, tmp_path):
    """Under --dry-run compile only records the command and returns no engine."""
    ctx = ctx_for(spec_for(tiny_gpt2, tp=2, dry_run=True), tmp_path / "compile")
    assert engine.compile(exported, ctx) is None
    assert ctx.record.commands and ctx.record.commands[0][0] == "trtllm-build"
    assert ctx.record.executed is False and not (ctx.workdir / "engine").exists()


def test_missing_trtllm_build_through_the_cli(tiny_gpt2, tmp_path, monkeypatch, capsys):
    """Without trtllm-build: exit 3, one line naming the tool, the exact command and --target python."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    out = tmp_path / "repo"
    code = main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out), "--tp", "2",
                 "--target", "tensorrtllm", "--backend-version", "v0.9.0"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 3, line
    assert line.startswith("forge: error: trtllm-build is not installed")
    assert "--target python" in line
    assert "trtllm-build --checkpoint_dir" in line and "--max_output_len 16" in line  # 32 positions: 16 + 16
    assert not out.exists()


def test_dry_run_build_prints_the_plan(tiny_gpt2, tmp_path, capsys):
    """forge build --dry-run prints each stage and the trtllm-build command; nothing is written."""
    out = tmp_path / "repo"
    code = main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out), "--tp", "2",
                 "--quant", "fp8", "--dry-run"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "export" in printed and "quantize" in printed and "compile" in printed
    assert "$ trtllm-build --checkpoint_dir" in printed and "--max_seq_len 32" in printed
    assert not out.exists()
