"""``--quant`` on the LLM-API layout (the newest release): nvidia-modelopt's unified Hugging Face checkpoint.

The PyTorch backend of the LLM API reads ``hf_quant_config.json`` (``quantization.quant_algo``) beside the weights,
or ``quantization_config`` in ``config.json``; the checkpoint must reload as safetensors with every quantized layer's
scales. Bad inputs tried: ``--quant w8a16`` (no such checkpoint from modelopt's export for this backend) — the rest
are in tests/decoders/test_llmapi.py.
"""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors import safe_open

from forge.cli import main

pytestmark = pytest.mark.heavy


@pytest.mark.parametrize("mode, algo, weight_dtype", [("int4_awq", "W4A16_AWQ", "uint8"),
                                                        ("fp8", "FP8", "float8_e4m3fn")])
def test_a_quantized_build_carries_the_quantization_the_pytorch_backend_reads(mode, algo, weight_dtype, calib_llama,
                                                                            tmp_path):
    out = tmp_path / "repo"
    assert main(["build", "--family", "llama", "--model", str(calib_llama), "--out", str(out), "--quant", mode,
                 "-o", "calib_size=4", "-o", "calib_seq_len=32"]) == 0
    hf = out / "tensorrt_llm" / "1" / "hf"
    quant = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == algo
    assert json.loads((hf / "config.json").read_text())["quantization_config"]["quant_algo"] == algo
    assert (hf / "tokenizer.json").is_file()
    with safe_open(hf / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        for layer in range(2):
            for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
                name = f"model.layers.{layer}.{proj}"
                assert str(f.get_tensor(f"{name}.weight").dtype).removeprefix("torch.") == weight_dtype
                assert f"{name}.weight_scale" in keys
    doc = yaml.safe_load((out / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert doc["model"] == "hf" and "quant_config" not in doc  # the LLM API reads it from the checkpoint
    manifest = json.loads((out / "forge-manifest.json").read_text())
    notes = [s["notes"] for c in manifest["components"] for s in c["stages"] if s["stage"] == "quantize"]
    assert notes and notes[0]["quantize"]["method"] == "nvidia-modelopt unified HF checkpoint"


def test_a_mode_the_release_cannot_load_is_refused_before_calibration(calib_llama, tmp_path, capsys):
    """Bad input: --quant w8a16 on the LLM-API layout."""
    assert main(["build", "--family", "llama", "--model", str(calib_llama), "--out", str(tmp_path / "r"),
                 "--quant", "w8a16"]) == 2
    assert "cannot load it" in capsys.readouterr().err and not (tmp_path / "r").exists()
