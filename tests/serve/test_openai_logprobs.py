"""Log-probabilities, token-id prompts, ``n`` choices and vLLM's sampling extensions through the OpenAI API on
the LLM-API layout, computed by the served model.

The real SmolLM2-135M-Instruct is built for the python target in the LLM-API layout (the newest release, no
--backend-version) in float32, once with the engine inside the python stub (streaming) and once in a process of
its own (``-o engine_process=true``, the GPU default); one real tritonserver serves both. Every log-prob is compared
with transformers in-process (float32) within 1e-3, through the real ``openai`` client and raw HTTP.

Bad inputs tried: a token id past the vocabulary, an empty token list (alone and inside a batch), completions
``logprobs`` 6 and -1, chat ``top_logprobs`` 21 and without ``logprobs``, ``n`` 0 and 129, ``best_of`` other
than ``n``, and raw Triton requests sending both ``text_input`` and ``prompt_token_ids``, a negative
``sampling_param_logprobs`` and ``prompt_token_ids`` past the vocabulary (each a per-request error, the model
keeps serving).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_openai import assert_openai_error, post, pytestmark, smollm2, tokenizer  # noqa: E402,F401

TOLERANCE = 1e-3
PROMPTS = ["The capital of France is", "One, two, three,"]


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    """The plain build (streaming) answers the OpenAI API; the ``p_`` build (engine process, not decoupled) is
    asked through Triton's HTTP endpoint."""
    from forge.cli import main
    from forge.openai_front import OpenAIServer
    from forge.server.triton_server import TritonServer
    from forge.testing import merge_repositories

    root = tmp_path_factory.mktemp("logprobs")
    common = ["build", "--family", "llama", "--model", str(smollm2), "--target", "python",
              "--dtype", "float32", "-o", "compute_dtype=float32", "--max-input-len", "256", "--max-seq-len", "320"]
    assert main([*common, "--out", str(root / "smollm2")]) == 0  # the default: decoupled
    # not decoupled, so Triton's HTTP endpoint takes its requests
    assert main([*common, "-o", "engine_process=true", "-o", "decoupled=false", "--name-prefix", "p_",
                 "--out", str(root / "hosted")]) == 0
    merged = merge_repositories([root / "smollm2", root / "hosted"], root / "merged")
    with TritonServer(merged, log_file=root / "tritonserver.log", startup_timeout=900.0) as triton:
        front = OpenAIServer(root / "smollm2", triton.grpc_url, port=0).start()
        try:
            yield triton, front
        finally:
            front.stop()


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[1].url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(smollm2):
    """Token ids → the model's log-probs at every position ([len, vocab], float32, transformers in-process)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1).numpy()

    return logprobs


def test_echo_scores_token_prompts_as_lm_eval_asks(served, tokenizer, reference):
    """lm-eval's loglikelihood request: a batch of token-id prompts, echo, logprobs 1, max_tokens 1 (and 0)."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    for max_tokens in (1, 0):
        status, body = post(f"{served[1].url}/completions", {
            "model": "smollm2", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0})
        assert status == 200, body
        assert [c["index"] for c in body["choices"]] == [0, 1]
        for ids, choice in zip(prompts, body["choices"]):
            scores = choice["logprobs"]
            expected = reference(ids)
            shown = len(ids) + max_tokens
            assert len(scores["tokens"]) == len(scores["token_logprobs"]) == len(scores["text_offset"]) == shown
            assert scores["token_logprobs"][0] is None and scores["top_logprobs"][0] is None
            for i in range(1, len(ids)):
                assert abs(scores["token_logprobs"][i] - expected[i - 1, ids[i]]) < TOLERANCE
                best = int(expected[i - 1].argmax())
                top = scores["top_logprobs"][i]
                assert max(top.values()) == pytest.approx(float(expected[i - 1, best]), abs=TOLERANCE)
                assert (ids[i] == best) == (scores["token_logprobs"][i] == max(top.values()))  # lm-eval's is_greedy
            assert "".join(scores["tokens"][:len(ids)]) == tokenizer.decode(ids)
            assert scores["text_offset"][:2] == [0, len(scores["tokens"][0])]
            if max_tokens:
                following = int(expected[-1].argmax())
                assert abs(scores["token_logprobs"][-1] - expected[-1, following]) < TOLERANCE
            else:
                assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == len(prompts) * max_tokens


def test_generated_tokens_log_probs_equal_the_model_s(client, tokenizer, reference):
    answer = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    scores = answer.choices[0].logprobs
    ids = tokenizer.encode(PROMPTS[0])
    generated = tokenizer.encode(PROMPTS[0] + answer.choices[0].text)[len(ids):]
    expected = reference(ids + generated)
    for i, (token, logprob, top) in enumerate(zip(generated, scores.token_logprobs, scores.top_logprobs)):
        assert abs(logprob - expected[len(ids) - 1 + i, token]) < TOLERANCE
        assert len(top) == 3 and logprob == max(top.values())  # greedy: the chosen token is the likeliest
    assert "".join(scores.tokens) == answer.choices[0].text


def test_chat_log_probs_whole_and_streamed(client, tokenizer, reference):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model="smollm2", messages=question, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=4)
    content = answer.choices[0].logprobs.content
    assert "".join(t.token for t in content) == answer.choices[0].message.content
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    expected = reference(ids + [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t.token))[0] for t in content])
    for i, token in enumerate(content):
        assert bytes(token.bytes).decode() == token.token
        alternatives = [t.logprob for t in token.top_logprobs]
        assert len(alternatives) == 4 and alternatives == sorted(alternatives, reverse=True)
        assert abs(alternatives[0] - float(expected[len(ids) - 1 + i].max())) < TOLERANCE
    streamed = client.chat.completions.create(model="smollm2", messages=question, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=4, stream=True)
    pieces = [t for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for t in chunk.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in pieces] == [(t.token, round(t.logprob, 4)) for t in content]


def test_streamed_completion_log_probs_with_echo(served, tokenizer):
    body = {"model": "smollm2", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "echo": True}
    status, whole = post(f"{served[1].url}/completions", body)
    assert status == 200, whole
    import openai

    client = openai.OpenAI(base_url=served[1].url, api_key="unused", max_retries=0)
    chunks = list(client.completions.create(**body, stream=True))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole["choices"][0]["text"]


def test_n_choices_vary_with_the_seed_and_agree_when_greedy(client):
    sampled = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, n=3,
                                        temperature=1.0, seed=7)
    again = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, n=3,
                                      temperature=1.0, seed=7)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in sampled.choices}) > 1
    greedy = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, n=2, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert greedy.usage.completion_tokens == 12 and greedy.choices[1].finish_reason == "length"
    streamed = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, n=2, temperature=0, stream=True)
    texts, reasons = ["", ""], [None, None]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [greedy.choices[0].message.content] * 2 and reasons == ["length", "length"]


@pytest.mark.parametrize("path, body, param, words", [
    ("completions", {"prompt": [49152]}, "prompt", "outside the model's vocabulary"),
    ("completions", {"prompt": []}, "prompt", "empty"),
    ("completions", {"prompt": [[1, 2], []]}, "prompt", "empty"),
    ("completions", {"prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("completions", {"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of", "must equal n"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("chat/completions", {"n": 0}, "n", "greater than or equal to 1"),
])
def test_bad_token_level_requests(served, path, body, param, words):
    payload = {"model": "smollm2", "max_tokens": 2, **body}
    if path == "chat/completions":
        payload["messages"] = [{"role": "user", "content": "Hi"}]
    status, answer = post(f"{served[1].url}/{path}", payload)
    assert_openai_error(status, answer, 400, words)
    assert answer["error"]["param"] == param


def _triton(served, model: str, **inputs):
    import tritonclient.http as http

    client = http.InferenceServerClient(served[0].http_url)
    tensors = []
    for name, (value, kind) in inputs.items():
        tensor = http.InferInput(name, value.shape, kind)
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    return client.infer(model, tensors)


def test_the_engine_process_answers_the_model_s_log_probs(served, tokenizer, reference):
    ids = tokenizer.encode(PROMPTS[0])
    answer = _triton(served, "p_tensorrt_llm", text_input=(np.array([b""], dtype=object), "BYTES"),
                     prompt_token_ids=(np.array(ids, dtype=np.int32), "INT32"),
                     sampling_param_max_tokens=(np.array([4], dtype=np.int32), "INT32"),
                     sampling_param_logprobs=(np.array([2], dtype=np.int32), "INT32"),
                     sampling_param_prompt_logprobs=(np.array([1], dtype=np.int32), "INT32"))
    generated = [json.loads(answer.as_numpy("logprobs")[0])]
    prompt = json.loads(answer.as_numpy("prompt_logprobs")[0])
    assert prompt[0] is None and len(prompt) == len(ids) and len(generated[0]) == 4
    chosen = [int(next(iter(p))) for p in generated[0]]
    expected = reference(ids + chosen)
    for i, position in enumerate(prompt[1:], start=1):
        assert next(iter(position)) == str(ids[i])  # the prompt's own token first
        assert abs(position[str(ids[i])]["logprob"] - expected[i - 1, ids[i]]) < TOLERANCE
    for i, position in enumerate(generated[0]):
        assert abs(position[str(chosen[i])]["logprob"] - expected[len(ids) - 1 + i, chosen[i]]) < TOLERANCE
        assert position[str(chosen[i])]["rank"] == 1 and len(position) == 2  # greedy: the likeliest, and one more


@pytest.mark.parametrize("inputs, words", [
    ({"text_input": (np.array([b"Hello"], dtype=object), "BYTES")}, "not both"),
    ({"sampling_param_logprobs": (np.array([-1], dtype=np.int32), "INT32")}, "sampling_param_logprobs must be"),
    ({"prompt_token_ids": (np.array([49152], dtype=np.int32), "INT32")}, "outside the vocabulary"),
])
def test_bad_token_level_tensors_are_per_request_errors(served, inputs, words):
    from tritonclient.utils import InferenceServerException

    asked = {"text_input": (np.array([b""], dtype=object), "BYTES"),
             "prompt_token_ids": (np.array([1, 2, 3], dtype=np.int32), "INT32"), **inputs}
    with pytest.raises(InferenceServerException, match=words):
        _triton(served, "p_tensorrt_llm", **asked)
    ok = _triton(served, "p_tensorrt_llm", text_input=(np.array([b"Hi"], dtype=object), "BYTES"))
    assert ok.as_numpy("text_output") is not None


def test_vllm_sampling_extensions_on_the_llm_api_layout(client):
    """ignore_eos (aiperf's fixed output lengths), min_tokens and repetition_penalty, carried by the python
    target's own inputs."""
    question = [{"role": "user", "content": "Say hi."}]
    plain = client.chat.completions.create(model="smollm2", messages=question, max_tokens=48, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 48
    forced = client.chat.completions.create(model="smollm2", messages=question, max_tokens=48, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 48
    longer = client.chat.completions.create(model="smollm2", messages=question, max_tokens=48, temperature=0,
                                            extra_body={"min_tokens": plain.usage.completion_tokens + 5})
    assert longer.usage.completion_tokens >= plain.usage.completion_tokens + 5
    repeated = "one one one one one one one one"
    same = client.completions.create(model="smollm2", prompt=repeated, max_tokens=8, temperature=0)
    penalised = client.completions.create(model="smollm2", prompt=repeated, max_tokens=8, temperature=0,
                                          extra_body={"repetition_penalty": 1.5})
    assert same.choices[0].text != penalised.choices[0].text


def test_continuous_usage_stats_count_every_streamed_token(served):
    """vLLM's ``stream_options.continuous_usage_stats`` (aiperf's per-chunk usage): the default build streams a
    token per chunk, each chunk's usage one token more."""
    import openai

    client = openai.OpenAI(base_url=served[1].url, api_key="unused", max_retries=0)
    chunks = list(client.completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=6, temperature=0, stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].text]
    # a chunk per token (streamed by default; a token that ends inside a character waits for the next)
    assert counted == sorted(set(counted)) and counted[-1] == 6 and len(counted) >= 5, counted
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == chunks[0].usage.prompt_tokens
