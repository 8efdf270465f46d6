"""Guided decoding (``guided_decoding_guide_type`` / ``guided_decoding_guide``) in the --target python decoder.

The engine tests drive the continuous-batching engine directly (no Triton) on the session's tiny random
GPT-2 and its real tokenizer, eagerly and through graphs.GraphDecoder's static KV cache (the graph path);
the served tests ask the real tritonserver of conftest through the ensemble. Random weights generate
garbage, but the grammar fixes its shape: every guided output must parse and validate.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from forge.in_triton.python_target.forge_decoder import graphs, guided  # noqa: E402
from forge.in_triton.python_target.forge_decoder.engine import Engine, load_model  # noqa: E402
from forge.in_triton.python_target.forge_decoder.request import (GenerationRequest, Guide, Limits, RequestError,
    SamplingParams, parse)
from forge.in_triton.python_target.forge_decoder.sequences import Sequence  # noqa: E402

PROMPT = "What is machine learning?"
# Short, bounded outputs. The JSON grammar allows any whitespace between tokens (as TensorRT-LLM compiles
# schemas), which a random model fills with "\r" and "\n": few members keep its answers short.
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
          "required": ["color"], "additionalProperties": False}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3}
REGEX = r"[a-z]{3,6}-[0-9]{2}"


@pytest.fixture(scope="module")
def tokenizer(tiny_gpt2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_gpt2))


@pytest.fixture(scope="module")
def model(tiny_gpt2):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(tiny_gpt2, torch.device("cpu"), torch.float32)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def guides(tiny_gpt2, model):
    return guided.Guides(tiny_gpt2, model.get_output_embeddings().weight.shape[0])


@pytest.fixture(params=["eager", "static"])
def decoding(request, monkeypatch):
    """``static``: decode through graphs.GraphDecoder (the arithmetic a GPU captures as CUDA graphs)."""
    if request.param == "static":
        monkeypatch.setattr(graphs, "FIRST_COLUMNS", 8)
    return request.param


def generate(model, decoding, requests, guides=None):
    """Run ``requests`` through one engine; each sequence's generated ids and finish reason."""
    if guides is not None:
        guides.prepare(requests)
    vocab = model.get_output_embeddings().weight.shape[0]
    engine = Engine(model, Limits(vocab, 64, 128), max_rows=8)
    if decoding == "static":
        assert engine.use_graphs("auto", capture=False).startswith("static KV cache")
    updates = {}
    seqs = [Sequence(r, lambda seq, update: updates.setdefault(id(seq), []).append(update)) for r in requests]
    engine.submit(seqs)
    engine.run_until_idle()
    return [(s.output, updates[id(s)][-1].reason) for s in seqs]


def ask(tokenizer, n, kind=None, text="", **kwargs):
    return GenerationRequest(tokenizer(PROMPT)["input_ids"], n, end_id=tokenizer.eos_token_id,
                             guide=None if kind is None else Guide(kind, text), **kwargs)


def test_json_schema_and_regex_guides_shape_greedy_and_sampled_rows(model, tokenizer, guides, decoding):
    """A json_schema row's text parses and validates, a regex row's matches, greedy and sampled alike;
    both end at the grammar's end (reason end_id, the end token left out)."""
    schema, array = json.dumps(SCHEMA), json.dumps(ARRAY)
    rows = [ask(tokenizer, 100, "json_schema", schema), ask(tokenizer, 40, "regex", REGEX),
            ask(tokenizer, 100, "json_schema", schema, sampling=SamplingParams(top_k=20, seed=7)),
            ask(tokenizer, 40, "regex", REGEX, sampling=SamplingParams(top_p=0.9, temperature=1.3, seed=3)),
            ask(tokenizer, 40, "ebnf_grammar", 'root ::= ("yes" | "no") " " [0-9]'),
            ask(tokenizer, 100, "json_schema", array), ask(tokenizer, 100, "json_schema", array,
                                                            sampling=SamplingParams(top_k=20, seed=5))]
    results = generate(model, decoding, rows, guides)
    assert [reason for _, reason in results] == ["end_id"] * len(rows)
    assert all(tokenizer.eos_token_id not in ids for ids, _ in results)
    texts = [tokenizer.decode(ids) for ids, _ in results]
    for text in (texts[0], texts[2]):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in texts[5:]:
        jsonschema.validate(json.loads(text), ARRAY)
    assert re.fullmatch(REGEX, texts[1]) and re.fullmatch(REGEX, texts[3])
    assert re.fullmatch(r"(yes|no) [0-9]", texts[4])


def test_rows_without_a_guide_are_unchanged_by_guided_rows_beside_them(model, tokenizer, guides, decoding):
    """Unguided rows (greedy and seeded sampling) give the same ids with or without guided rows in the batch."""
    plain = [ask(tokenizer, 16), ask(tokenizer, 12, sampling=SamplingParams(top_k=30, seed=11))]
    alone = generate(model, decoding, plain)
    mixed = generate(model, decoding, [ask(tokenizer, 16), ask(tokenizer, 60, "regex", REGEX),
                                       ask(tokenizer, 12, sampling=SamplingParams(top_k=30, seed=11)),
                                       ask(tokenizer, 100, "json_schema", json.dumps(SCHEMA))], guides)
    assert [mixed[0], mixed[2]] == alone
    assert re.fullmatch(REGEX, tokenizer.decode(mixed[1][0]))


def test_the_json_type_needs_no_guide_and_gives_json(model, tokenizer, guides):
    (ids, reason), = generate(model, "eager", [ask(tokenizer, 100, "json")], guides)
    text = tokenizer.decode(ids)
    assert text.lstrip()[:1] in "{[", text
    if reason == "end_id":  # a random model may ramble inside a string until the length runs out
        json.loads(text)


def test_structural_tags_in_tensorrt_llm_form_constrain_what_follows_a_trigger(model, tokenizer, guides):
    """TensorRT-LLM's structural_tag guide: free text, but after ``<n>`` a JSON integer, then ``</n>``."""
    tag = json.dumps({"structures": [{"begin": "<n>", "schema": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "end": "</n>"}], "triggers": ["<n>"]})
    grammar = guides.compile(Guide("structural_tag", tag))
    matcher = guided.Matcher(guided.Grammar(grammar, []))
    for token in tokenizer("hello <n>")["input_ids"]:
        assert matcher.accept(token)
    allowed = guided.allowed([matcher], guides.vocab_size, torch.device("cpu"))[0]
    texts = {tokenizer.decode([t]) for t in allowed.nonzero().view(-1).tolist()}
    assert texts and all(re.fullmatch(r"\s*[0-9]*", t) for t in texts), texts


def tensors(**extra):
    t = {"input_ids": np.array([[1, 2, 3]], np.int32), "input_lengths": np.array([[3]], np.int32),
         "request_output_len": np.array([[5]], np.int32)}
    t.update({k: np.array([[v.encode()]], object) for k, v in extra.items()})
    return t


@pytest.mark.parametrize("kind, text, message", [
    ("json_schema", "not json", "guided_decoding_guide is not valid JSON, so not a json_schema"),
    ("json_schema", '["a list"]', "guided_decoding_guide is not a JSON schema"),
    ("json_schema", '{"type": 5}', "guided_decoding_guide is not a valid json_schema guide: "),
    ("regex", "([a-z]", "guided_decoding_guide is not a valid regex guide: "),
    ("ebnf_grammar", "root ::= undefined_rule", "guided_decoding_guide is not a valid ebnf_grammar guide: "),
    ("structural_tag", "{}", "guided_decoding_guide is not a valid structural_tag guide: "),
    ("yaml", "a: 1", "guided_decoding_guide_type 'yaml' is not one of json, json_schema, regex"),
    ("regex", "", "guided_decoding_guide_type 'regex' needs a guided_decoding_guide"),
    ("", "[a-z]+", "'guided_decoding_guide' is not supported without 'guided_decoding_guide_type'"),
])
def test_a_bad_guide_is_one_clear_request_error(guides, kind, text, message):
    limits = Limits(guides.vocab_size, 64, 128)
    with pytest.raises(RequestError) as caught:
        guides.prepare(parse(tensors(guided_decoding_guide_type=kind, guided_decoding_guide=text), limits,
                             decoupled=False))
    assert message in str(caught.value) and "\n" not in str(caught.value) and "/project/" not in str(caught.value)


def test_guided_inputs_left_empty_mean_no_guide(guides):
    rows = parse(tensors(guided_decoding_guide_type="", guided_decoding_guide=""), Limits(guides.vocab_size, 64, 128),
                 decoupled=False)
    guides.prepare(rows)
    assert rows[0].guide is None and rows[0].grammar is None


def test_compiled_grammars_are_kept_in_an_lru(tiny_gpt2, guides):
    small = guided.Guides(tiny_gpt2, guides.vocab_size, cache_size=2)
    first = small.compile(Guide("regex", "a+"))
    assert small.compile(Guide("regex", "a+")) is first
    small.compile(Guide("regex", "b+"))
    small.compile(Guide("regex", "a+"))  # used last: b+ goes first
    small.compile(Guide("regex", "c+"))
    assert list(small._cache) == [Guide("regex", "a+"), Guide("regex", "c+")]


def test_without_xgrammar_a_guided_request_gets_an_error_naming_the_package(tiny_gpt2, monkeypatch):
    monkeypatch.setattr(guided, "load_xgrammar", lambda: None)
    missing = guided.Guides(tiny_gpt2, 330)
    assert "xgrammar" in missing.unavailable()
    rows = [GenerationRequest([1, 2], 4, guide=Guide("json")), GenerationRequest([1, 2], 4)]
    with pytest.raises(RequestError, match="guided decoding is not available: the python package 'xgrammar'"):
        missing.prepare(rows)
    missing.prepare(rows[1:])  # unguided requests never need it


def test_without_a_tokenizer_guided_decoding_says_so():
    assert "no tokenizer" in guided.Guides(None, 330).unavailable()


# -- served through a real tritonserver (conftest's session server) ------------------------------------

def post_generate(server, model: str, **body):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate",
                                     data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.heavy
def test_ensemble_json_schema_guide_gives_text_that_validates(server):
    status, body = post_generate(server, "ensemble", text_input=PROMPT, max_tokens=100, exclude_input_in_output=True,
                                 guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(SCHEMA))
    assert status == 200, body
    jsonschema.validate(json.loads(body["text_output"]), SCHEMA)
    status, body = post_generate(server, "ensemble", text_input=PROMPT, max_tokens=40, exclude_input_in_output=True,
                                 guided_decoding_guide_type="regex", guided_decoding_guide=REGEX)
    assert status == 200 and re.fullmatch(REGEX, body["text_output"]), body


@pytest.mark.heavy
@pytest.mark.parametrize("kind, guide, message", [
    ("json_schema", '{"type": 5}', "guided_decoding_guide is not a valid json_schema guide"),
    ("regex", "([a-z]", "guided_decoding_guide is not a valid regex guide"),
    ("xml", "<a/>", "guided_decoding_guide_type 'xml' is not one of"),
])
def test_ensemble_bad_guide_is_a_request_error_and_the_server_keeps_serving(server, kind, guide, message):
    status, body = post_generate(server, "ensemble", text_input=PROMPT, max_tokens=8,
                                 guided_decoding_guide_type=kind, guided_decoding_guide=guide)
    assert status == 400 and message in body["error"], body
    status, body = post_generate(server, "ensemble", text_input=PROMPT, max_tokens=3)
    assert status == 200 and body["text_output"].startswith(PROMPT)
