"""LoRA on the LLM-API layout (the newest release): adapters shipped in the model's ``lora/<name>/`` as PEFT
checkpoints, ``model.yaml``'s ``lora_config`` derived from them, requests naming them (lora_id, lora_name,
lora_path) the way ``LoRARequest`` takes them. Bad inputs tried: an adapter patching a module the release's
PyTorch backend serves no LoRA for; on the python target, an adapter name the build did not ship, a lora_id that is
not that adapter's, a partial triple.
"""

from __future__ import annotations

import json

import yaml

from forge import tritonconfig as tc
from forge.cli import main
from forge.in_triton import forge_llmapi
from forge.clients.inference import ModelInputs
from forge.clients.lora_requests import LoraRequests, repository_adapters


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
    from forge.llm import lora_format as lora

    monkeypatch.setattr(lora, "LLMAPI_MODULES", lora.LLMAPI_MODULES - {"mlp_gate"})
    assert build(models, tmp_path / "repo") == 2
    err = capsys.readouterr().err
    assert "LoRA adapter B patches mlp_gate" in err and "serves no LoRA for" in err
    assert not (tmp_path / "repo").exists()


def test_the_python_target_serves_the_adapters_by_name(models, tmp_path):
    """The same interface on forge's engine: a request naming an adapter answers as transformers + PEFT does. Bad
    inputs: an adapter name the build did not ship, a lora_id that is not that adapter's, a partial triple."""
    import json as _json
    import urllib.error
    import urllib.request

    from transformers import AutoTokenizer

    from forge.server.triton_server import TritonServer
    from lora_models import greedy, peft_model

    out = tmp_path / "repo"
    assert build(models, out, "--target", "python", "--dtype", "float32", "-o", "compute_dtype=float32",
                 "--max-input-len", "64", "--max-seq-len", "128") == 0
    adapters = repository_adapters(out)
    tokenizer = AutoTokenizer.from_pretrained(str(models["llama"]))
    prompt = "hello world"
    ids = tokenizer.encode(prompt)
    eos = tokenizer.eos_token_id

    def ask(server, **body):
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/tensorrt_llm/generate", method="POST",
                                         data=_json.dumps({"text_input": prompt, "sampling_param_max_tokens": 8,
                                                           "sampling_param_exclude_input_from_output": True,
                                                           **body}).encode())
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return 200, _json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json.loads(exc.read())

    with TritonServer(out, log_file=tmp_path / "tritonserver.log") as server:
        for name in (None, "A", "B"):
            model = peft_model(models["llama"], None if name is None else models[f"llama_{name}"])
            expected = tokenizer.decode(greedy(model, ids, 8, eos), skip_special_tokens=True)
            lora = {} if name is None else {"lora_id": adapters[name].task_id, "lora_name": name, "lora_path": name}
            status, answer = ask(server, **lora)
            assert status == 200 and answer["text_output"] == expected, (name, answer)
        status, answer = ask(server, lora_id=1, lora_name="C", lora_path="C")
        assert status == 400 and "no LoRA adapter 'C' here" in answer["error"]
        status, answer = ask(server, lora_id=adapters["B"].task_id, lora_name="A", lora_path="A")
        assert status == 400 and "is lora_id 1 here" in answer["error"]
        status, answer = ask(server, lora_id=1, lora_name="A")
        assert status == 400 and "missing lora_path" in answer["error"]
