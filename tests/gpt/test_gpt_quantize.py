"""GPT-2 quantized checkpoints: the defects issue 14 found, each with its regression test.

1. int4_awq / fp8 said ``position_embedding_type: rope_gpt_neox`` (modelopt's config): a different model;
2. fp8 must carry every scale TensorRT-LLM's loader needs; int8_kv must not fail inside forge;
3. ``forge export --quant`` wrote an unquantized checkpoint (``quant_algo: null``);
4. weight-only layers TensorRT-LLM would pad (widths not multiples of 64·tp) are refused, not written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge.cli import main
from forge.llm import weight_quant as quantize
from forge.llm.tensorio import SafetensorsFile

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj")


@pytest.fixture(autouse=True)
def two_threads():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def export(model: Path, out: Path, *args) -> int:
    return main(["export", "--backend-version", ENGINE, "--family", "gpt", "--model", str(model), "--out", str(out), "-o", "calib_size=4",
                 *map(str, args)])


def tensors(path: Path) -> dict[str, str]:
    f = SafetensorsFile(path)
    try:
        return {name: ref.tag for name, ref in f.refs.items()}
    finally:
        f.close()


def last_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("mode", ["int4_awq", "fp8"])
def test_quantized_gpt2_keeps_its_learned_position_table(quant_gpt2, tmp_path, mode):
    """Regression 1: the quantized config is forge's own (learned positions, gelu_new), the table is in rank 0."""
    out = tmp_path / "ckpt"
    assert export(quant_gpt2, out, "--quant", mode) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["position_embedding_type"] == "learned_absolute"
    assert (config["architecture"], config["hidden_act"]) == ("GPTForCausalLM", "gelu_new")
    assert "transformer.position_embedding.weight" in tensors(out / "rank0.safetensors")
    assert config["producer"]["quantized_by"].startswith("nvidia-modelopt")


def test_fp8_writes_every_scale_the_loader_needs(quant_gpt2, tmp_path):
    """Regression 2: every FP8 linear of every rank has its weight and activation scales."""
    out = tmp_path / "ckpt"
    assert export(quant_gpt2, out, "--quant", "fp8", "--tp", "2") == 0
    assert json.loads((out / "config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    for rank in range(2):
        names = tensors(out / f"rank{rank}.safetensors")
        for i in range(2):
            for linear in LINEARS:
                base = f"transformer.layers.{i}.{linear}"
                assert names[f"{base}.weight"] == "F8_E4M3"
                assert {f"{base}.weights_scaling_factor", f"{base}.activation_scaling_factor"} <= set(names)


def test_missing_scales_are_refused_in_one_line(quant_gpt2, tmp_path, capsys, monkeypatch):
    """Regression 2: a modelopt that leaves out activation scales fails the export, naming a missing tensor."""
    real = quantize.export_modelopt

    def without_activation_scales(adapter, model, out, dtype, tp, pp):
        config = real(adapter, model, out, dtype, tp, pp)
        from safetensors.torch import load_file, save_file  # numpy has no float8

        for rank in range(tp * pp):
            path = out / f"rank{rank}.safetensors"
            kept = {k: v for k, v in load_file(path).items() if not k.endswith("activation_scaling_factor")}
            save_file(kept, path)
        return config

    monkeypatch.setattr(quantize, "export_modelopt", without_activation_scales)
    out = tmp_path / "ckpt"
    assert export(quant_gpt2, out, "--quant", "fp8") == 1
    line = last_error(capsys)
    assert "tensor(s) TensorRT-LLM's loader needs" in line and "activation_scaling_factor" in line
    assert not out.exists()


def test_int8_kv_gpt2_at_tp2(quant_gpt2, tmp_path):
    """Regression 2: int8_kv alone on GPT-2: float weights, a KV-cache scale per layer on every rank."""
    out = tmp_path / "ckpt"
    assert export(quant_gpt2, out, "--quant", "int8_kv", "--tp", "2") == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["quantization"]["quant_algo"], config["quantization"]["kv_cache_quant_algo"]) == (None, "INT8")
    for rank in range(2):
        names = tensors(out / f"rank{rank}.safetensors")
        assert {f"transformer.layers.{i}.attention.kv_cache_scaling_factor" for i in range(2)} <= set(names)


def test_calibrated_modes_refuse_an_uneven_pipeline_split(tiny_gpt2, tmp_path, capsys):
    """Regression 2: 3 layers at --pp 2 asserted inside modelopt (a traceback); now one line before calibrating."""
    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out, "--quant", "int8_kv", "--pp", "2", "--backend-version", "v1.0.0") == 2
    line = last_error(capsys)
    assert "splits layers evenly" in line and "3 layers do not divide by 2" in line
    assert not out.exists()


@pytest.mark.parametrize("mode,algo,kv", [("fp8", "FP8", None), ("w8a16", "W8A16", None),
                                          ("w4a16,int8_kv", "W4A16", "INT8")])
def test_export_writes_the_quantized_checkpoint_build_compiles(quant_gpt2, tmp_path, mode, algo, kv):
    """Regression 3: forge export --quant writes what forge build's quantize stage hands to trtllm-build."""
    out = tmp_path / "ckpt"
    assert export(quant_gpt2, out, "--quant", mode) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["quantization"]["quant_algo"], config["quantization"]["kv_cache_quant_algo"]) == (algo, kv)
    manifest = json.loads((out / "forge-manifest.json").read_text())
    stages = [s["stage"] for s in manifest["components"][0]["stages"]]
    assert stages == ["export", "quantize"]
    assert manifest["components"][0]["artifact"]["meta"]["quant"]["quant_algo"] == algo


def test_plain_export_stays_unquantized(tiny_gpt2, tmp_path):
    """Without --quant the export stage alone runs and says so in the config."""
    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out) == 0
    assert json.loads((out / "config.json").read_text())["quantization"] == {"quant_algo": None,
                                                                            "kv_cache_quant_algo": None}


@pytest.mark.parametrize("args,fragment", [
    (("--quant", "w8a16", "--tp", "2"), "W8A16 layers to multiples of 64·tp = 128"),
    (("--quant", "w4a16"), "W4A16 layers to multiples of 64·tp = 64"),
    (("--quant", "int4_awq"), "W4A16_AWQ layers to multiples of max(64, group size 16)·tp = 64"),
])
def test_widths_tensorrt_llm_would_pad_are_refused(tiny_gpt2, tmp_path, capsys, args, fragment):
    """Regression 4: hidden 48 is no multiple of 64·tp; TensorRT-LLM would expect padded tensors."""
    out = tmp_path / "ckpt"
    assert export(tiny_gpt2, out, *args) == 2
    line = last_error(capsys)
    assert fragment in line, line
    assert not out.exists()
