"""LoRA on the LLM-API layout (the newest release): adapters shipped in the model's ``lora/<name>/`` as PEFT
checkpoints, ``model.yaml``'s ``lora_config`` derived from them, requests naming them (lora_id, lora_name,
lora_path) the way ``LoRARequest`` takes them. Bad inputs tried: an adapter patching a module the release's
PyTorch backend serves no LoRA for, ``--lora`` on the python target of this interface.
"""

from __future__ import annotations

import json

import yaml

from forge import tritonconfig as tc
from forge.cli import main
from forge.served import forge_llmapi
from forge.serving.client import ModelInputs
from forge.serving.lora import LoraRequests, repository_adapters


def build(models, out, *extra) -> int:
    return main(["build", "--family", "llama", "--model", str(models["llama"]), "--out", str(out),
                 "--lora", f"A={models['llama_A']}", "--lora", f"B={models['llama_B']}", *extra])


def test_adapters_ship_as_peft_checkpoints_and_configure_the_llm_api(models, tmp_path):
    out = tmp_path / "repo"
    assert build(models, out, "-o", "max_loras=2") == 0
    model_dir = out / "tensorrt_llm" / "1"
    for name in ("A", "B"):
        source = models[f"llama_{name}"]
        assert json.loads((model_dir / "lora" / name / "adapter_config.json").read_text()) == \
            json.loads((source / "adapter_config.json").read_text())
        assert (model_dir / "lora" / name / "adapter_model.safetensors").read_bytes() == \
            (source / "adapter_model.safetensors").read_bytes()
    lora = yaml.safe_load((model_dir / "model.yaml").read_text())["lora_config"]
    assert lora["lora_dir"] == ["lora/A", "lora/B"] and lora["max_lora_rank"] == 4 and lora["max_loras"] == 2
    assert set(lora["lora_target_modules"]) == {"attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h",
                                                "mlp_4h_to_h", "mlp_gate"}
    # a client names an adapter; the model finds it in its own lora/ folder
    adapters = repository_adapters(out)
    inputs = ModelInputs.from_config(json.loads(json.dumps(_as_dict(tc.read(out / "tensorrt_llm")))))
    extra = LoraRequests(inputs).tensors(adapters["B"], True)
    tensors = {"text_input": inputs.array("text_input", "hello"), **extra}
    parsed = forge_llmapi.parse(tensors, decoupled=False)
    call = forge_llmapi.request_arguments(parsed, str(model_dir))
    assert call["lora"] == {"lora_name": "B", "lora_int_id": adapters["B"].task_id,
                            "lora_path": str((model_dir / "lora" / "B").resolve()), "lora_ckpt_source": "hf"}


def _as_dict(config) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def test_an_adapter_on_a_module_the_release_cannot_serve_is_refused(models, tmp_path, capsys, monkeypatch):
    from forge.llm import lora

    monkeypatch.setattr(lora, "LLMAPI_MODULES", lora.LLMAPI_MODULES - {"mlp_gate"})
    assert build(models, tmp_path / "repo") == 2
    err = capsys.readouterr().err
    assert "LoRA adapter B patches mlp_gate" in err and "serves no LoRA for" in err
    assert not (tmp_path / "repo").exists()


def test_the_python_target_of_this_interface_refuses_lora(models, tmp_path, capsys):
    assert build(models, tmp_path / "repo", "--target", "python") == 2
    assert "serves no LoRA adapters on TensorRT-LLM" in capsys.readouterr().err
