"""minilm builds: targets, options, quantization and the checkpoints it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from encoder_fixtures import build, built, cosine, manifest_notes

from forge.errors import EXIT_TOOL_MISSING, EXIT_USAGE


def copy_minilm(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(("target", "device", "given", "cuda", "float32"), [
    ("python", "auto", False, False, True),  # served by this onnxruntime, which has no GPU: float32
    ("python", "auto", False, True, False),  # this onnxruntime has a GPU: float16, the default
    ("python", "auto", True, False, False),  # --dtype float16 given: as asked
    ("python", "cpu", False, True, True),
    ("onnxruntime", "cpu", False, False, True),
    ("onnxruntime", "auto", False, False, False),  # Triton's onnxruntime backend runs where it is served
    ("tensorrt", "auto", False, False, False),
    (None, "auto", False, False, False),  # the default target, tensorrt
])
def test_the_default_dtype_follows_where_onnx_runtime_runs(monkeypatch, tmp_path, target, device, given, cuda,
                                                          float32):
    from forge.encoder import plugin
    from forge.encoder.plugin import cpu_float32
    from forge.spec import BuildSpec

    monkeypatch.setattr(plugin, "onnxruntime_has_cuda", lambda: cuda)
    spec = BuildSpec(families=["minilm"], model=tmp_path, out=tmp_path / "repo", dtype="float16", dtype_given=given,
                     target=target, options={} if device == "auto" else {"device": device})
    assert cpu_float32(spec) is float32
    assert not cpu_float32(BuildSpec(families=["minilm"], model=tmp_path, out=tmp_path, dtype="float32",
                                     dtype_given=given, target=target))


def test_the_cuda_check_agrees_with_onnxruntime_without_importing_it(tmp_path, monkeypatch):
    """The installed onnxruntime's own answer, and a package directory that holds the CUDA provider library."""
    import subprocess
    import sys

    code = ("import sys; from forge.encoder.plugin import onnxruntime_has_cuda; has = onnxruntime_has_cuda(); "
            "print(has, 'onnxruntime' in sys.modules)")
    has, imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True).stdout.split()
    import onnxruntime

    assert has == str("CUDAExecutionProvider" in onnxruntime.get_available_providers()) and imported == "False"
    fake = tmp_path / "onnxruntime"
    (fake / "capi").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "onnxruntime")  # found on the path again: the stand-in package
    from forge.encoder.plugin import onnxruntime_has_cuda

    assert not onnxruntime_has_cuda()
    (fake / "capi" / "libonnxruntime_providers_cuda.so").write_bytes(b"")
    assert onnxruntime_has_cuda()


def test_dry_run_prints_the_trtexec_command(minilm_model, tmp_path, capsys):
    """tensorrt is the default target; --dry-run shows the profile from --max-batch-size and max_seq_length."""
    code = build("--family", "minilm", "--model", str(minilm_model), "--out", str(tmp_path / "repo"),
                 "--max-batch-size", "16", "--dry-run")
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "repo").exists()
    line = next(line for line in out.splitlines() if "$ trtexec" in line)
    assert "--minShapes=input_ids:1x1,attention_mask:1x1" in line
    assert "--optShapes=input_ids:16x256,attention_mask:16x256" in line
    assert "--maxShapes=input_ids:16x256,attention_mask:16x256" in line
    assert "--fp16" in line and "--saveEngine=" in line and "--timingCacheFile=" in line
    assert "--int8" not in line


def test_dry_run_int8_adds_the_calibration_cache(minilm_model, tmp_path, capsys):
    code = build("--family", "minilm", "--model", str(minilm_model), "--out", str(tmp_path / "repo"),
                 "--quant", "int8", "--dtype", "float32", "-o", "padding=longest", "--dry-run")
    line = next(line for line in capsys.readouterr().out.splitlines() if "$ trtexec" in line)
    assert code == 0 and "--int8 --calib=" in line and "calibration.cache" in line and "--fp16" not in line
    assert "--optShapes=input_ids:8x128,attention_mask:8x128" in line  # longest padding: opt 128


@pytest.mark.heavy
def test_tensorrt_without_trtexec_fails_with_exit_3_and_the_command(minilm_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no trtexec anywhere
    code = build("--family", "minilm", "--model", str(minilm_model), "--out", str(tmp_path / "repo"))
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forge: error:")]
    assert code == EXIT_TOOL_MISSING and len(error) == 1
    assert "trtexec is not installed" in error[0] and "--target python" in error[0]
    assert "trtexec --onnx=" in error[0] and "--saveEngine=" in error[0] and "--fp16" in error[0]
    assert not (tmp_path / "repo").exists()


@pytest.mark.heavy
def test_onnxruntime_target_repository_passes_validate(minilm_model, tmp_path):
    from forge.cli import main
    from forge.tritonconfig import read

    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "onnxruntime",
                 "--dtype", "float32", "--instances", "2")
    assert main(["validate", str(repo)]) == 0
    encoder = read(repo / "minilm_encoder")
    assert encoder.platform == "onnxruntime_onnx" and encoder.instance_group[0].count == 2
    assert (repo / "minilm_encoder" / "1" / "model.onnx").is_file()
    assert not any(t.allow_ragged_batch for t in encoder.input)  # the ORT backend would flatten them
    tokenizer = read(repo / "minilm_tokenizer")
    assert tokenizer.backend == "python" and tokenizer.parameters["padding"].string_value == "longest"
    assert {s.model_name for s in read(repo / "ensemble").ensemble_scheduling.step} == {"minilm_tokenizer",
                                                                                         "minilm_encoder"}


@pytest.mark.heavy
def test_int8_parity_is_reported_and_served_graph_is_quantized(minilm_model, tmp_path):
    import onnx
    from sentence_transformers import SentenceTransformer

    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "python",
                 "--quant", "int8")
    notes = manifest_notes(repo, "minilm", "quantize")
    assert notes["quantization"]["mode"] == "dynamic" and notes["quantization"]["quant"] == "int8"
    assert notes["parity"]["precision"] == "int8" and notes["parity"]["min_cosine"] > 0.95
    assert notes["parity"]["scaled_diff"] <= notes["parity"]["tolerance"]
    graph = onnx.load(str(repo / "minilm_encoder" / "1" / "model.onnx")).graph
    assert any(node.op_type in ("MatMulInteger", "DynamicQuantizeLinear") for node in graph.node)

    # the served graph, run in process on the served tokenizer's output, stays close to sentence-transformers
    texts = ["A man is eating food.", "Quantized embeddings stay close.", ""]
    served = served_graph_outputs(repo, texts)
    expected = SentenceTransformer(str(minilm_model), device="cpu").encode(texts, normalize_embeddings=True)
    assert cosine(served, expected).min() > 0.95


@pytest.mark.heavy
def test_parity_tolerance_fails_the_build(minilm_model, tmp_path, capsys):
    """A tolerance the export cannot meet fails with exit 1 and the measured difference."""
    code = build("--family", "minilm", "--model", str(minilm_model), "--target", "python", "--dtype", "float32",
                 "--parity-tolerance", "1e-12", "--out", str(tmp_path / "repo"))
    err = capsys.readouterr().err
    assert code == 1 and "ONNX export parity" in err and "exceeds the tolerance 1e-12" in err
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("args, message", [
    (["-o", "padding=sideways"], "padding"),
    (["-o", "instances=0"], "instances"),
    (["-o", "opset=9"], "opset"),
    (["--dtype", "bfloat16"], "does not support --dtype bfloat16"),
    (["--quant", "int4_awq"], "does not support --quant int4_awq"),
    (["--target", "tensorrtllm"], "cannot be built for --target tensorrtllm"),
])
def test_bad_options_are_usage_errors(minilm_model, tmp_path, capsys, args, message):
    """Bad option values: one line, exit 2, nothing written."""
    code = build("--family", "minilm", "--model", str(minilm_model), "--out", str(tmp_path / "repo"),
                 "--target", "python", "--dry-run", *args) if "--target" not in args else \
        build("--family", "minilm", "--model", str(minilm_model), "--out", str(tmp_path / "repo"), *args)
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forge: error:")]
    assert code == EXIT_USAGE and len(error) == 1 and message in error[0]


def test_unsupported_module_is_refused(minilm_model, tmp_path, capsys):
    """modules.json with a module forge cannot put in a graph (Dense) is a usage error."""
    model = copy_minilm(minilm_model, tmp_path / "model")
    modules = json.loads((model / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (model / "modules.json").write_text(json.dumps(modules))
    code = build("--family", "minilm", "--model", str(model), "--out", str(tmp_path / "repo"), "--dry-run")
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "sentence_transformers.models.Dense" in err and "supported: Transformer" in err


def test_unsupported_pooling_is_refused(minilm_model, tmp_path, capsys):
    model = copy_minilm(minilm_model, tmp_path / "model")
    config = model / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode_mean_tokens": False,
                                  "pooling_mode_weightedmean_tokens": True}))
    code = build("--family", "minilm", "--model", str(model), "--out", str(tmp_path / "repo"), "--dry-run")
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "weightedmean" in err and "forge supports cls, max, mean" in err


def test_wrong_architecture_lists_the_supported_ones(minilm_model, tmp_path, capsys):
    model = copy_minilm(minilm_model, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    code = build("--family", "minilm", "--model", str(model), "--out", str(tmp_path / "repo"), "--dry-run")
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "'GPT2LMHeadModel' is not supported" in err and "BertModel" in err


def test_pickle_only_checkpoint_is_refused(minilm_model, tmp_path, capsys):
    model = copy_minilm(minilm_model, tmp_path / "model")
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    code = build("--family", "minilm", "--model", str(model), "--out", str(tmp_path / "repo"), "--dry-run")
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "pickle" in err and "--allow-pickle" in err


def test_truncated_weights_are_refused(minilm_model, tmp_path, capsys):
    model = copy_minilm(minilm_model, tmp_path / "model")
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    code = build("--family", "minilm", "--model", str(model), "--out", str(tmp_path / "repo"), "--dry-run")
    assert code == EXIT_USAGE and "truncated" in capsys.readouterr().err


def tiny_sentence_model(minilm_model: Path, out: Path, config, modes=("mean",), normalize=False) -> Path:
    """A random-initialised sentence-transformers directory around ``config`` (MiniLM's WordPiece tokenizer)."""
    import torch
    from transformers import AutoModel

    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_model / name, out / name)
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config.hidden_size if hasattr(config, "hidden_size") else config.dim,
        "pooling_mode_cls_token": "cls" in modes, "pooling_mode_mean_tokens": "mean" in modes,
        "pooling_mode_max_tokens": "max" in modes,
        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens" in modes}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    return out


def served_graph_outputs(repo: Path, texts: list[str]):
    """Run the repository's tokenizer and encoder graph in process, as the server would."""
    import onnxruntime as ort

    from forge.in_triton.encoder_models.tokenizer import from_parameters
    from forge.tritonconfig import read

    params = {k: v.string_value for k, v in read(repo / "minilm_tokenizer").parameters.items()}
    feeds = from_parameters(params, str(repo / "minilm_tokenizer" / "1"))(texts)
    session = ort.InferenceSession(str(repo / "minilm_encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


TEXTS = ["a short one", "", "a much longer sentence " * 20]


@pytest.mark.heavy
@pytest.mark.parametrize("modes", [("cls",), ("max",), ("mean_sqrt_len_tokens",), ("cls", "mean")])
def test_pooling_modes_match_sentence_transformers(minilm_model, tmp_path, modes):
    """A tiny random BERT with each pooling mode (and no Normalize) exports to sentence-transformers' numbers."""
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig

    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    model = tiny_sentence_model(minilm_model, tmp_path / "model", config, modes)
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(model), "--target", "python",
                 "--dtype", "float32")
    assert manifest_notes(repo, "minilm", "export")["interface"]["pooling"] == list(modes)
    served = served_graph_outputs(repo, TEXTS)
    expected = SentenceTransformer(str(model), device="cpu").encode(TEXTS)
    assert served.shape == expected.shape == (3, 32 * len(modes))
    np.testing.assert_allclose(served, expected, atol=2e-5)


@pytest.mark.heavy
@pytest.mark.parametrize("architecture", ["RobertaModel", "XLMRobertaModel", "MPNetModel", "DistilBertModel"])
def test_other_bert_style_architectures(minilm_model, tmp_path, architecture):
    """Every architecture the family lists exports and matches sentence-transformers (tiny random models)."""
    from sentence_transformers import SentenceTransformer
    from transformers import DistilBertConfig, MPNetConfig, RobertaConfig, XLMRobertaConfig

    small = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    config = {
        "RobertaModel": lambda: RobertaConfig(**small, max_position_embeddings=130, pad_token_id=1),
        "XLMRobertaModel": lambda: XLMRobertaConfig(**small, max_position_embeddings=130, pad_token_id=1),
        "MPNetModel": lambda: MPNetConfig(**small, max_position_embeddings=130, pad_token_id=1),
        "DistilBertModel": lambda: DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                                    max_position_embeddings=128),
    }[architecture]()
    model = tiny_sentence_model(minilm_model, tmp_path / "model", config, normalize=True)
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(model), "--target", "python",
                 "--dtype", "float32")
    assert manifest_notes(repo, "minilm", "export")["interface"]["architecture"] == architecture
    expected = SentenceTransformer(str(model), device="cpu").encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(served_graph_outputs(repo, TEXTS), expected, atol=2e-5)
