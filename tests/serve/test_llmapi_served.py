"""The python target under the newest release: the LLM-API ``tensorrt_llm`` interface served by the real
tritonserver (``l_tensorrt_llm`` built ``-o decoupled=false``, and ``ls_tensorrt_llm`` as built by default,
decoupled; see conftest).

Same model, same greedy answers as the engine layout's ensemble and as transformers; text in, text out; the
interface's defaults (the prompt echoed unless ``sampling_param_exclude_input_from_output``, optional outputs only
when asked) and its errors. Bad inputs tried: ``image_url`` with ``file://`` and a local path (the model is not
multimodal either), ``streaming`` on the non-decoupled model, LoRA inputs the model does not serve,
``sampling_param_best_of`` 2, a negative temperature, an empty prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_python_target import PROMPT, generate, hf_greedy, hf_model, stream, tokenizer  # noqa: F401  (fixtures)

pytestmark = pytest.mark.heavy

PLAIN, STREAMING = "l_tensorrt_llm", "ls_tensorrt_llm"


def expected_text(tokenizer, hf_model, prompt: str, n: int) -> str:
    ids = tokenizer.encode(prompt)
    out = hf_greedy(hf_model, ids, n)
    if tokenizer.eos_token_id in out:  # the tokenizer's end id ends generation, as on the engine layout
        out = out[: out.index(tokenizer.eos_token_id)]
    return tokenizer.decode(out, skip_special_tokens=True)


def test_greedy_text_equals_transformers_and_the_engine_layout(server, tokenizer, hf_model):
    status, body = generate(server, PLAIN, text_input=PROMPT, sampling_param_max_tokens=12)
    assert status == 200, body
    assert set(body) == {"model_name", "model_version", "text_output"}  # optional outputs only when asked
    assert body["text_output"] == PROMPT + expected_text(tokenizer, hf_model, PROMPT, 12)  # echoed by default
    status, engine = generate(server, "ensemble", text_input=PROMPT, max_tokens=12, bad_words="", stop_words="")
    assert status == 200 and engine["text_output"] == body["text_output"]


def test_exclude_input_and_the_asked_outputs(server, tokenizer, hf_model):
    status, body = generate(server, PLAIN, text_input=PROMPT, sampling_param_max_tokens=6,
                            sampling_param_exclude_input_from_output=True, return_finish_reason=True,
                            return_stop_reason=True, return_cumulative_logprob=True,
                            sampling_param_return_perf_metrics=True)
    assert status == 200, body
    assert body["text_output"] == expected_text(tokenizer, hf_model, PROMPT, 6)
    assert body["finish_reason"] in ("length", "stop") and body["stop_reason"] == ""
    assert body["cumulative_logprob"] < 0
    assert 0 < body["arrival_time_ns"] <= body["first_token_time_ns"] <= body["last_token_time_ns"]


def test_the_default_token_budget_is_sampling_params_default(server, tokenizer):
    status, body = generate(server, PLAIN, text_input=PROMPT, sampling_param_exclude_input_from_output=True,
                            return_finish_reason=True)
    assert status == 200, body
    if body["finish_reason"] == "length":
        assert len(tokenizer.encode(body["text_output"])) >= 28  # 32 tokens (re-encoding may merge a few)


def test_streamed_pieces_add_up_to_the_whole_answer(server):
    def tensors(streaming: bool):
        return {"text_input": np.array([PROMPT.encode()], object), "sampling_param_max_tokens": np.array([10], np.int32),
                "streaming": np.array([streaming]), "sampling_param_exclude_input_from_output": np.array([True]),
                "return_finish_reason": np.array([True])}

    pieces = stream(server, STREAMING, tensors(True))
    (whole,) = stream(server, STREAMING, tensors(False))
    texts = [r.as_numpy("text_output").reshape(-1)[0] for r in pieces]
    assert len(texts) >= 2 and b"".join(texts) == whole.as_numpy("text_output").reshape(-1)[0]
    assert pieces[-1].as_numpy("finish_reason").reshape(-1)[0] in (b"length", b"stop")


def test_stream_interval_sends_the_first_token_at_once_then_three_a_response(server):
    """``-o stream_interval=3`` (``li_``): for 10 tokens, 4 responses (1 + 3 + 3 + 3) where the default build sends
    10, the same text; each response's own text is what its tokens decode to."""
    tensors = {"text_input": np.array([PROMPT.encode()], object), "sampling_param_max_tokens": np.array([10], np.int32),
               "streaming": np.array([True]), "sampling_param_exclude_input_from_output": np.array([True]),
               "return_finish_reason": np.array([True])}
    every = stream(server, STREAMING, tensors)
    assert every[-1].as_numpy("finish_reason").reshape(-1)[0] == b"length" and len(every) == 10
    held = stream(server, "li_tensorrt_llm", tensors)
    assert len(held) == 4 and held[-1].as_numpy("finish_reason").reshape(-1)[0] == b"length"
    assert [r.as_numpy("finish_reason").reshape(-1)[0] for r in held[:-1]] == [b""] * 3
    texts = [r.as_numpy("text_output").reshape(-1)[0] for r in every]
    assert [r.as_numpy("text_output").reshape(-1)[0] for r in held] == [
        texts[0], b"".join(texts[1:4]), b"".join(texts[4:7]), b"".join(texts[7:])]


@pytest.mark.parametrize("body, message", [
    ({"image_url": "file:///etc/passwd"}, "image_url"),
    ({"image_url": "/etc/passwd"}, "image_url"),
    ({"streaming": True}, "Streaming is only supported in decoupled mode."),
    ({"lora_id": 1, "lora_name": "a", "lora_path": "a"}, "built without LoRA adapters"),
    ({"sampling_param_best_of": 2}, "best_of"),
    ({"sampling_param_temperature": -1.0}, "0 or more"),
    ({"text_input": ""}, "no tokens"),
])
def test_bad_requests_get_an_error_and_the_model_keeps_serving(server, body, message):
    status, answer = generate(server, PLAIN, **{"text_input": PROMPT, "sampling_param_max_tokens": 4, **body})
    assert status == 400 and message in answer["error"], answer
    status, answer = generate(server, PLAIN, text_input=PROMPT, sampling_param_max_tokens=2)
    assert status == 200, answer


@pytest.fixture(scope="module")
def fronts(server, repos):
    """The OpenAI API over each LLM-API build (its catalog read from that repository)."""
    from forge.openai_front import OpenAIServer

    served = {name: OpenAIServer(repos[name], server.grpc_url, port=0).start() for name in ("l_", "ls_")}
    try:
        yield served
    finally:
        for front in served.values():
            front.stop()


def test_the_openai_api_answers_as_on_the_engine_layout(fronts, tokenizer, hf_model):
    import openai

    expected = expected_text(tokenizer, hf_model, PROMPT, 8)
    for name, front in fronts.items():
        client = openai.OpenAI(base_url=front.url, api_key="none")
        answer = client.completions.create(model=front.catalog.model_id, prompt=PROMPT, max_tokens=8, temperature=0)
        assert answer.choices[0].text == expected, name
        assert answer.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    client = openai.OpenAI(base_url=fronts["ls_"].url, api_key="none")
    chunks = [c.choices[0].text for c in client.completions.create(
        model=fronts["ls_"].catalog.model_id, prompt=PROMPT, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(chunks) == expected and len([c for c in chunks if c]) >= 2  # token by token


def test_forge_infer_and_bench_find_the_text_model(server, capsys):
    from forge.cli import main

    capsys.readouterr()
    assert main(["infer", PROMPT, "--max-tokens", "4", "--url", server.http_url, "--model", PLAIN]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)
    assert main(["bench", f"{server.grpc_url}#{PLAIN}", "--concurrency", "2", "--json", "prompts", "--prompt",
                 "hello there", "--num-requests", "4", "--output-len", "4"]) == 0
