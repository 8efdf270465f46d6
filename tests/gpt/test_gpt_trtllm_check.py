"""GPT-2 checkpoints and trtllm-build command lines checked by TensorRT-LLM's own code.

``../shared/trtllm-check`` holds TensorRT-LLM 0.16.0.dev2024121000's Python source: every checkpoint
the gpt tests export (plain, quantized, pipeline splits) is loaded per rank with that release's
``from_checkpoint`` in strict mode, and every ``trtllm-build`` command forge records for
``--backend-version v0.16.0`` (the one release this source speaks for) is parsed by its argparse.
Accepted there ≠ an engine was built. Where the directory is absent (a user's machine) this skips.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from gpt_models import make_gpt2

import forge_gpt
from forge.cli import main
from forge.llm import trtllm_build as engine, loadercheck, quantlayout
from forge.spec import BuildSpec, Limits
from forge.testing import use_plugins

CHECK = Path(__file__).resolve().parents[2].parent / "shared" / "trtllm-check"
pytestmark = pytest.mark.skipif(not (CHECK / "check_ckpt.py").is_file(),
                                reason=f"TensorRT-LLM checker absent ({CHECK}); CI runs these")

PLAIN = {  # name → (model, export arguments); "tiny" is the suite's GPT-2: odd vocab 101, tied, 3 layers
    "fp16": ("tiny", ("--dtype", "float16")),
    "bf16-tp2": ("tiny", ("--dtype", "bfloat16", "--tp", "2")),
    "fp32-tp4": ("tiny", ("--dtype", "float32", "--tp", "4")),
    "fp16-pp3": ("tiny", ("--pp", "3", "--backend-version", "v0.16.0")),
    "fp16-tp2-pp3": ("tiny", ("--tp", "2", "--pp", "3", "--backend-version", "v0.16.0")),
    "wide-tp2": ("quant", ("--tp", "2")),
    "wide-pp2": ("quant", ("--pp", "2")),
}
#: every quantization forge offers (weight modes alone and with int8_kv) × tp 1, 2, plus a pipeline split
QUANT_MODES = ("w8a16", "w4a16", "int4_awq", "fp8", "int8_kv",
               "w8a16,int8_kv", "w4a16,int8_kv", "int4_awq,int8_kv", "fp8,int8_kv")
QUANT = {f"{mode}-tp{tp}": ("quant", ("--quant", mode, "--tp", str(tp))) for mode in QUANT_MODES for tp in (1, 2)}
QUANT.update({"int4_awq-pp2": ("quant", ("--quant", "int4_awq", "--pp", "2")),
              "fp8,int8_kv-tp2-pp2": ("quant", ("--quant", "fp8,int8_kv", "--tp", "2", "--pp", "2"))})
CASES = {**PLAIN, **QUANT}

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> loadercheck.Checker:
    return loadercheck.at(CHECK, tmp_path_factory.mktemp("trtllm-src"))


@pytest.fixture(scope="module")
def verdicts(checker, tmp_path_factory, quant_gpt2) -> dict[str, tuple[bool, str]]:
    """Export every case (calibration on 4 samples, 2 threads), then load them all in one checker process."""
    import torch

    root = tmp_path_factory.mktemp("exports")
    models = {"tiny": make_gpt2(root / "tiny"), "quant": quant_gpt2}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    dirs = {}
    with use_plugins(("gpt", forge_gpt.plugin)), pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGE_CACHE_DIR", str(root / "cache"))
        mp.delenv(loadercheck.ENV, raising=False)
        for name, (model, args) in CASES.items():
            out = dirs[name] = root / name
            code = main(["export", "--backend-version", ENGINE, "--family", "gpt", "--model", str(models[model]), "--out", str(out),
                         "-o", "calib_size=4", *args])
            assert code == 0, name
    torch.set_num_threads(threads)
    found = checker.check_checkpoints(list(dirs.values()))
    return {name: found[d] for name, d in dirs.items()}


@pytest.mark.parametrize("case", CASES)
def test_export_passes_the_strict_loader(case, verdicts):
    ok, line = verdicts[case]
    assert ok, line
    assert "GPTForCausalLM" in line


def test_uneven_split_for_v1_is_what_0_16_cannot_load(checker, tmp_path):
    """3 layers at --pp 2 are written for 1.0's split ([0,1] | [2]); 0.16 gives each stage 3 // 2 and rejects it.

    This is why forge refuses uneven splits before --backend-version v1.0.0 (tested in test_gpt_export).
    """
    out = tmp_path / "ckpt"
    model = make_gpt2(tmp_path / "m", n_layer=3)
    assert main(["export", "--backend-version", ENGINE, "--family", "gpt", "--model", str(model), "--out", str(out), "--pp", "2",
                 "--backend-version", "v1.0.0"]) == 0
    ok, line = checker.check_checkpoints([out])[out]
    assert not ok and "transformer.layers.1" in line, line


def test_padded_widths_would_not_load(checker, tmp_path, monkeypatch):
    """What forge refuses: w8a16 at tp 2 with hidden 48 (TensorRT-LLM pads to 128) — its loader rejects it."""
    monkeypatch.setattr(quantlayout, "check_widths", lambda *a, **k: None)
    out = tmp_path / "ckpt"
    model = make_gpt2(tmp_path / "m")
    assert main(["export", "--backend-version", ENGINE, "--family", "gpt", "--model", str(model), "--out", str(out), "--quant", "w8a16",
                 "--tp", "2"]) == 0
    ok, line = checker.check_checkpoints([out])[out]
    assert not ok and "attention.qkv" in line, line


def test_build_records_what_was_checked(checker, quant_gpt2, tmp_path, monkeypatch, capsys):
    """FORGE_TRTLLM_CHECK set: the manifest says the checkpoint and the command were accepted, and by which source."""
    fake = tmp_path / "bin" / "trtllm-build"
    fake.parent.mkdir()
    fake.write_text(FAKE_TRTLLM_BUILD.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(loadercheck.ENV, str(CHECK))
    out = tmp_path / "repo"
    assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(quant_gpt2), "--out", str(out), "--quant", "fp8",
                 "-o", "calib_size=4", "--backend-version", "v0.16.0"]) == 0
    assert "--max-seq-len 2048 → 64 and --max-input-len 1024 → 32" in capsys.readouterr().err
    stages = {s["stage"]: s["notes"] for s in json.loads((out / "forge-manifest.json").read_text())
              ["components"][0]["stages"]}
    source = f"TensorRT-LLM {checker.version} source"
    assert "trtllm_check" not in stages["export"]  # the quantized checkpoint is the one checked
    assert stages["quantize"]["trtllm_check"]["checkpoint"]["result"] == "accepted"
    assert stages["quantize"]["trtllm_check"]["checkpoint"]["by"] == source
    assert stages["compile"]["trtllm_check"]["build_command"] == {
        "result": "accepted", "by": source, "output": stages["compile"]["trtllm_check"]["build_command"]["output"]}
    assert stages["compile"]["limits"]["used"] == {"max_input_len": 32, "max_seq_len": 64}
    monkeypatch.delenv(loadercheck.ENV)
    plain = tmp_path / "plain"
    assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(quant_gpt2), "--out", str(plain)]) == 0
    stages = {s["stage"]: s["notes"] for s in json.loads((plain / "forge-manifest.json").read_text())
              ["components"][0]["stages"]}
    assert stages["export"]["trtllm_check"]["checkpoint"]["result"].startswith("not checked")
    assert stages["compile"]["trtllm_check"]["build_command"]["result"].startswith("not checked")


FAKE_TRTLLM_BUILD = """#!{python}
import json, sys
from pathlib import Path
args = sys.argv[1:]
ckpt, out = Path(args[args.index("--checkpoint_dir") + 1]), Path(args[args.index("--output_dir") + 1])
mapping = json.loads((ckpt / "config.json").read_text())["mapping"]
out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text(json.dumps({{"version": "fake", "pretrained_config": {{"mapping": mapping}}}}))
for r in range(mapping["world_size"]):
    (out / f"rank{{r}}.engine").write_bytes(b"engine")
"""

# trtllm-build command lines forge records for v0.16.0: every branch of engine.build_command
COMMANDS = {
    "fp16": ({"dtype": "float16"}, {}),
    "fp32 (no fused MHA)": ({"dtype": "float32"}, {}),
    "fp8 (no gemm plugin)": ({"dtype": "bfloat16", "quant": {"quant_algo": "FP8"}}, {}),
    "tp4 workers": ({"dtype": "float16", "world_size": 4}, {}),
    "options": ({"dtype": "float16"}, {"context_fmha": False, "paged_context_fmha": False,
                                       "multiple_profiles": False, "trtllm_build_args": "--log_level verbose"}),
}


@pytest.mark.parametrize("case", COMMANDS)
def test_build_commands_for_v0_16_parse(case, checker, tmp_path):
    meta, options = COMMANDS[case]
    spec = BuildSpec(families=["gpt"], model=tmp_path, out=tmp_path, backend_version="v0.16.0",
                     limits=Limits(max_batch_size=4, max_input_len=100, max_seq_len=300, max_num_tokens=4096,
                                   max_beam_width=2))
    argv = engine.build_command(Path("ckpt"), Path("engine"), {"max_position_embeddings": 1024, **meta},
                                spec, options)
    rc, line = checker.run("trtllm_build_args.py", ["--src", str(checker.src), "--", *argv])
    assert rc == 0, f"{' '.join(argv)}: {line}"
    assert checker.speaks_for("v0.16.0") and not checker.speaks_for("v1.0.0") and not checker.speaks_for(None)
