"""A model process without transformers' model and tokenizer classes: ``native`` weights and the backend tokenizer.

The static decoder reads a checkpoint's weights under transformers' names; ``native.load`` builds that tree from
the safetensors files, and ``forge_text.BackendTokenizer`` answers from the ``tokenizers`` backend that forge
build checked against transformers' tokenizer. Checked here: greedy ids equal transformers' ``generate`` through
native weights (Llama with GQA, Qwen2's biases, Qwen3's q/k norms, tied and untied heads, llama3 and linear RoPE,
GPT-2), the rotary tables equal transformers' own, what is left to transformers and why, checkpoints whose
tensors do not match (refused, then loaded through transformers), and the tokenizer's answers. Bad inputs tried:
a quantized config, another activation, yarn RoPE, a partial rotary embedding, an unknown architecture, an extra
tensor, a missing tensor, a missing config key, tokenizer files changed after the build, a backend file
this tokenizers release cannot read, a tokenizer that decodes differently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_graphs import SHAPE, _generate, _model, _random, outputs  # noqa: E402

from forge.in_triton import forge_text  # noqa: E402
from forge.in_triton.python_target.forge_decoder import loading, native  # noqa: E402
from forge.in_triton.python_target.forge_decoder.engine import Engine  # noqa: E402
from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, Limits  # noqa: E402

ROPES = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32, "rope_theta": 500000.0},
         "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}


def _hf(kind: str):
    """A transformers model of ``kind`` (test_graphs' shapes; llama3 / linear: Llama with that RoPE)."""
    if kind not in ROPES:
        return _model(kind)
    import transformers

    config = transformers.LlamaConfig(**SHAPE, rope_parameters=ROPES[kind])
    torch.manual_seed(0)
    return _random(transformers.LlamaForCausalLM(config), 5)


def _saved(kind: str, tmp_path: Path):
    model = _hf(kind)
    model.save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gpt2", "llama3", "linear"])
def test_native_weights_decode_as_transformers_generates(kind, tmp_path):
    """Five prompts through 3 rows of the static decoder on native weights: each row's greedy ids equal its own
    ``generate`` on the transformers model in float32."""
    hf, path = _saved(kind, tmp_path)
    model = native.load(path, torch.device("cpu"), torch.float32)
    assert native.loaded_here(model) and type(model).__name__ == type(hf).__name__
    engine = Engine(model, Limits(vocab_size=hf.config.vocab_size, hidden_size=hf.config.hidden_size,
                                  max_input_len=32, max_seq_len=64), max_rows=3)
    assert engine.use_graphs("auto").startswith(("static", "paged")) and engine.graphs is not None
    prompts = [[5, 17, 9], [3], [44, 2, 8, 100, 7, 7, 1], [60, 61], [11, 12, 13, 14]]
    got = outputs(engine, [GenerationRequest(prompt=p, max_new_tokens=12) for p in prompts])
    assert got == [_generate(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama3", "linear"])
def test_rotary_tables_equal_transformers(kind, tmp_path):
    hf, path = _saved(kind, tmp_path)
    model = native.load(path, torch.device("cpu"), torch.float32)
    x, positions = torch.zeros(1, dtype=torch.bfloat16), torch.arange(200)[None]
    for mine, theirs in zip(model.model.rotary_emb(x, positions), hf.model.rotary_emb(x, positions)):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


def test_tied_and_untied_heads_follow_the_config(tmp_path):
    qwen2, path = _saved("qwen2", tmp_path)  # tied
    model = native.load(path, torch.device("cpu"), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    llama, path = _saved("llama", tmp_path)  # its own head
    model = native.load(path, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(model.lm_head.weight, llama.lm_head.weight.to(torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_sharded_checkpoints_load_from_every_shard(tmp_path):
    hf = _hf("qwen3")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model = native.load(tmp_path / "sharded", torch.device("cpu"), torch.float32)
    theirs = dict(hf.named_parameters())
    mine = dict(model.named_parameters())
    assert mine.keys() <= theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("change, reason", [
    ({"quantization_config": {"quant_method": "awq"}}, "quantized"),
    ({"hidden_act": "gelu"}, "activation is gelu"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope type 'yarn'"),
    ({"partial_rotary_factor": 0.5}, "part of each head"),
    ({"architectures": ["PhiForCausalLM"]}, "PhiForCausalLM is not one of"),
])
def test_what_stays_with_transformers_says_why(change, reason):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", **change}
    assert reason in native.why_not(config)
    assert native.why_not({"architectures": ["LlamaForCausalLM"]}) is None
    assert "gelu_fast" in native.why_not({"architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_fast"})


def test_checkpoints_whose_tensors_differ_are_refused_then_loaded_through_transformers(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = _saved("llama", tmp_path)
    state = load_file(str(path / "model.safetensors"))
    save_file({**state, "model.extra.weight": torch.zeros(2)}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensors the model does not: model.extra.weight"):
        native.load(path, torch.device("cpu"), torch.float32)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensor model.layers.1.mlp.up_proj.weight"):
        native.load(path, torch.device("cpu"), torch.float32)
    warned = []
    model, how = loading._single({}, path, torch.device("cpu"), torch.float32, warned.append)
    assert how == "transformers" and not native.loaded_here(model) and "up_proj" in warned[0]
    config = native.read_config(path)
    del config["num_hidden_layers"]
    with pytest.raises(ValueError, match="no config key num_hidden_layers"):
        native.load(path, torch.device("cpu"), torch.float32, config)


def _config(**parameters: str) -> dict:
    return {"parameters": {k: {"string_value": v} for k, v in parameters.items()}, "max_batch_size": 4}


def test_the_weights_alone_where_the_static_decoder_runs_else_transformers(tmp_path):
    """Native weights by default; transformers for -o cuda_graphs=false, and where the static
    decoder turns out not to run (a sliding window shorter than max_seq_len): loaded again, with a warning."""
    _, path = _saved("llama", tmp_path)
    cpu, f32 = torch.device("cpu"), torch.float32
    assert loading._single(_config(), path, cpu, f32, print)[1] == "weights loaded by forge"
    assert loading._single(_config(cuda_graphs="false"), path, cpu, f32, print)[1] == "transformers"
    import transformers

    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=16))
    windowed.save_pretrained(tmp_path / "1" / "hf")
    warned = []
    lora = '{"1": "model.layers.{i}.self_attn.q_proj"}'  # its adapters hook the model loaded again
    loaded = loading.load(_config(weights="hf", max_seq_len="64", compute_dtype="float32", lora_modules=lora),
                          tmp_path / "1", print, warned.append, print)
    assert "(transformers)" in loaded.summary and loaded.engine.graphs is None
    assert loaded.loras.modules.model is loaded.engine.model and not native.loaded_here(loaded.engine.model)
    assert any("sliding window" in w and "through transformers" in w for w in warned)


# -- the tokenizer ------------------------------------------------------------------------------------------

def _metaspace_tokenizer(path: Path, clean_up: bool) -> Path:
    """A SentencePiece-style BPE (▁ for spaces, byte fallback, a BOS template) as transformers saves it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(["Hello world, it's a test. The quick brown fox jumps over the lazy dog."] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            clean_up_tokenization_spaces=clean_up).save_pretrained(path)
    return path


TEXTS = ["Hello world , it's a test .", "  two  spaces\nand a tab\t!", "émoji 🙂 日本語 — done ?",
         "<s>x</s> y n't"]


@pytest.mark.parametrize("which", ["gpt2", "metaspace", "metaspace-clean-up"])
def test_the_backend_tokenizer_answers_as_transformers(which, tiny_gpt2, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    path = str(shutil.copytree(tiny_gpt2, tmp_path / which) if which == "gpt2"
               else _metaspace_tokenizer(tmp_path / which, which.endswith("clean-up")))
    theirs = AutoTokenizer.from_pretrained(path)
    data, why = forge_text.describe_backend(theirs, path, TEXTS)
    assert data is not None, why
    (Path(path) / forge_text.BACKEND_FILE).write_bytes(data)
    mine = forge_text.load_tokenizer(path, fast=True)
    assert isinstance(mine, forge_text.BackendTokenizer) and len(mine) == len(theirs)
    assert sorted(mine.all_special_ids) == sorted(theirs.all_special_ids)
    assert [(mine.bos_token_id, mine.eos_token_id, mine.pad_token_id)] == [
        (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)]
    for text in TEXTS + ["Paris ."]:
        for special in (True, False):
            ids = forge_text.token_ids(text, theirs, special)
            assert forge_text.token_ids(text, mine, special) == ids
            assert forge_text.decode(mine, ids, True) == forge_text.decode(theirs, ids, True)
    codec, reference = forge_text.TokenBytes(mine), forge_text.TokenBytes(theirs)
    assert codec.mode == reference.mode
    ids = forge_text.token_ids(TEXTS[2], theirs, False)
    assert codec.bytes_of(ids, True) == reference.bytes_of(ids, True)
    assert not isinstance(forge_text.load_tokenizer(path), forge_text.BackendTokenizer)  # only when asked
    assert not isinstance(forge_text.load_tokenizer(path, trust_remote_code=True, fast=True),
                          forge_text.BackendTokenizer)


def test_a_stale_or_unequal_backend_is_not_used(tiny_gpt2, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    path = shutil.copytree(tiny_gpt2, tmp_path / "tok")
    theirs = AutoTokenizer.from_pretrained(path)
    data, _ = forge_text.describe_backend(theirs, str(path), TEXTS)
    (path / forge_text.BACKEND_FILE).write_bytes(data)
    original = (path / "tokenizer_config.json").read_bytes()
    (path / "tokenizer_config.json").write_text(json.dumps({**json.loads(original), "model_max_length": 7}))
    assert forge_text.BackendTokenizer.from_dir(str(path)) is None  # the files changed after the build
    (path / "tokenizer_config.json").write_bytes(original)
    assert forge_text.BackendTokenizer.from_dir(str(path)) is not None
    doc = json.loads(data)
    (path / forge_text.BACKEND_FILE).write_text(json.dumps({**doc, "backend": '{"version": "9.9", "model": 1}'}))
    assert forge_text.BackendTokenizer.from_dir(str(path)) is None  # unreadable by this tokenizers release

    class Louder(type(theirs)):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()

    louder = Louder.from_pretrained(path)
    data, why = forge_text.describe_backend(louder, str(path), TEXTS)
    assert data is None and "decoding" in why


def test_a_text_model_process_loads_without_transformers_model_or_tokenizer_classes(server, repos):
    """What the default layout's model process does at load (its config as tritonserver hands it over), in a
    fresh interpreter: transformers' modeling and tokenizer modules are never imported."""
    import urllib.request

    here = repos["ls_"] / "ls_tensorrt_llm" / "1"
    assert (here / "hf" / forge_text.BACKEND_FILE).is_file()
    for text_model in ("preprocessing", "postprocessing"):  # the engine layout's text models load it too
        assert isinstance(forge_text.load_tokenizer(str(repos[""] / text_model / "1" / "tokenizer"), fast=True),
                          forge_text.BackendTokenizer)
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/ls_tensorrt_llm/config") as response:
        config = response.read().decode()
    code = f"""
import json, sys
sys.path.insert(0, {str(here)!r})
from forge_decoder import loading
from forge_decoder.textfront import TextFront
import forge_glue
config = json.loads({config!r})
front = TextFront({str(here / 'hf')!r}, forge_glue.parameters(config))
loaded = loading.load(config, __import__('pathlib').Path({str(here)!r}), print, print, print)
print(type(front.tokenizer).__name__, loaded.summary)
print(sorted(m for m in sys.modules if m.startswith(('transformers.models', 'transformers.modeling_utils',
                                                      'transformers.tokenization_utils'))))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    first, modules = done.stdout.strip().splitlines()[-2:]
    assert first.startswith("BackendTokenizer GPT2LMHeadModel (weights loaded by forge)"), done.stdout
    assert modules == "[]", modules
