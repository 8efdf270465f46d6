"""A tiny GPT-2 built with ``--target python`` and served by the real tritonserver, asked like TRT-LLM.

One server (see conftest) holds three builds: ``ensemble``/``tensorrt_llm`` (newest profile),
``s_ensemble``/``s_tensorrt_llm`` (``--decoupled``: streaming) and ``v5_…`` (``--backend-version v0.5.0``).
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from serve_models import MAX_SEQ_LEN

pytestmark = pytest.mark.heavy

PROMPT = "What is machine learning?"
CURL_BODY = '{"text_input": "What is machine learning?", "max_tokens": 20, "bad_words": "", "stop_words": ""}'


# -- helpers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_gpt2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_gpt2))


@pytest.fixture(scope="module")
def hf_model(tiny_gpt2):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_gpt2), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare exactly n tokens
    return model


def hf_greedy(model, ids, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def post(url: str, body: str | bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body.encode() if isinstance(body, str) else body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def generate(server, model: str, **body) -> tuple[int, dict]:
    return post(f"http://{server.http_url}/v2/models/{model}/generate", json.dumps(body))


def grpc_inputs(tensors: dict[str, np.ndarray]):
    import tritonclient.grpc as grpc
    from tritonclient.utils import np_to_triton_dtype

    result = []
    for name, array in tensors.items():
        tensor = grpc.InferInput(name, list(array.shape),
                                 "BYTES" if array.dtype == object else np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        result.append(tensor)
    return result


def llm_tensors(ids, n, **extra):
    tensors = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
               "request_output_len": np.array([[n]], np.int32)}
    tensors.update(extra)
    return tensors


def infer(server, model, tensors, request_id=""):
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(server.grpc_url)
    try:
        return client.infer(model, grpc_inputs(tensors), request_id=request_id)
    finally:
        client.close()


def stream(server, model, tensors, *, cancel_after: int | None = None, timeout=60.0, request_id=""):
    """Responses of one streamed request; with ``cancel_after`` the stream is cancelled after that many."""
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(server.grpc_url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    responses = []
    try:
        client.async_stream_infer(model, grpc_inputs(tensors), request_id=request_id,
                                  enable_empty_final_response=True)
        while True:
            result, error = events.get(timeout=timeout)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                responses.append(result)
            if cancel_after is not None and len(responses) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return responses
            if response.parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def metric(server, name: str, default: float | None = 0.0, **labels) -> float | None:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return default


# -- the seed documents' client ------------------------------------------------------------------

def test_curl_from_the_seed_documents_works_verbatim(server):
    url = f"http://{server.http_url}/v2/models/ensemble/generate"
    if shutil.which("curl"):
        done = subprocess.run(["curl", "-s", "-X", "POST", url, "-d", CURL_BODY], capture_output=True, text=True,
                              timeout=120)
        body = json.loads(done.stdout)
    else:
        status, body = post(url, CURL_BODY)
        assert status == 200
    assert body["model_name"] == "ensemble"
    assert body["text_output"].startswith(PROMPT) and len(body["text_output"]) > len(PROMPT)


def test_greedy_output_equals_transformers_generate(server, tokenizer, hf_model):
    ids = tokenizer.encode("The capital of France is")
    result = infer(server, "tensorrt_llm", llm_tensors(ids, 24))
    out = result.as_numpy("output_ids")[0, 0].tolist()
    assert out == ids + hf_greedy(hf_model, ids, 24)
    assert result.as_numpy("sequence_length").tolist() == [[len(ids) + 24]]


def test_ensemble_text_equals_transformers_generate(server, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPT)
    expected = hf_greedy(hf_model, ids, 12)
    eos = tokenizer.eos_token_id
    if eos in expected:  # the ensemble passes the tokenizer's end id, which ends generation
        expected = expected[: expected.index(eos)]
    status, body = generate(server, "ensemble", text_input=PROMPT, max_tokens=12, bad_words="", stop_words="")
    assert status == 200, body
    assert body["text_output"] == tokenizer.decode(ids + expected, skip_special_tokens=True)


def test_streaming_returns_the_same_tokens_as_non_streaming(server, tokenizer):
    ids = tokenizer.encode("hello world, streaming text")
    (single,) = stream(server, "s_tensorrt_llm", llm_tensors(ids, 16))  # decoupled: one response when not streaming
    whole = single.as_numpy("output_ids")[0, 0].tolist()
    responses = stream(server, "s_tensorrt_llm", llm_tensors(ids, 16, streaming=np.array([[True]])))
    pieces = [r.as_numpy("output_ids")[0, 0].tolist() for r in responses]
    assert len(pieces) == 16 and all(len(p) == 1 for p in pieces)  # one response per generated token
    assert ids + [t for p in pieces for t in p] == whole
    assert [r.as_numpy("sequence_length").tolist() for r in responses] == [[[1]]] * 16


def test_streamed_ensemble_text_adds_up_to_the_non_streamed_text(server):
    def ask(streaming: bool) -> list[bytes]:
        tensors = {"text_input": np.array([[PROMPT.encode()]], object), "max_tokens": np.array([[10]], np.int32),
                   "stream": np.array([[streaming]])}
        return [r.as_numpy("text_output").reshape(-1)[0] for r in stream(server, "s_ensemble", tensors)]

    pieces, (whole,) = ask(True), ask(False)
    # one token at a time can split a character, so compare bytes
    assert len(pieces) == 10 and whole.endswith(b"".join(pieces))


def test_concurrent_requests_of_mixed_lengths(server, tokenizer, hf_model):
    """Eight clients at once, different prompt and output lengths: each gets its own greedy answer."""
    prompts = ["hello", "What is machine learning? " * 3, "a quick brown fox", "The capital of France is Paris.",
               "stop words", "streaming text one token at a time", "hello world " * 5, "naive"]
    lengths = [3, 17, 8, 25, 1, 12, 30, 6]
    jobs = [(tokenizer.encode(p), n) for p, n in zip(prompts, lengths)]
    results: dict[int, list[int]] = {}

    def ask(index, ids, n):
        results[index] = infer(server, "tensorrt_llm", llm_tensors(ids, n)).as_numpy("output_ids")[0, 0].tolist()

    threads = [threading.Thread(target=ask, args=(i, ids, n)) for i, (ids, n) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (ids, n) in enumerate(jobs):
        assert results[i] == ids + hf_greedy(hf_model, ids, n), f"request {i}"
    # sequences finishing in the same step all leave the gauge (it once stayed above 0 when idle)
    deadline = time.monotonic() + 10
    while metric(server, "forge_decoder_sequences", model="tensorrt_llm") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "forge_decoder_sequences", model="tensorrt_llm") == 0
    # the engine thread's own counters: time in steps, decoding steps, rows over them
    steps = metric(server, "forge_decoder_engine_total", model="tensorrt_llm", kind="decode_steps")
    rows = metric(server, "forge_decoder_engine_total", model="tensorrt_llm", kind="decoded_rows")
    assert steps >= max(lengths) - 1 and steps <= rows <= 8 * steps  # the first token comes from the prefill
    step_s = metric(server, "forge_decoder_engine_total", model="tensorrt_llm", kind="step_seconds")
    assert 0 < metric(server, "forge_decoder_engine_total", model="tensorrt_llm", kind="prefill_seconds") < step_s
    # every request admitted once (previous tests of this server counted too), each having waited >= 0
    assert metric(server, "forge_decoder_engine_total", model="tensorrt_llm", kind="admitted") >= len(jobs)
    assert metric(server, "forge_decoder_engine_total", model="tensorrt_llm", kind="queued_seconds") >= 0
    # the device's time and the wait for it are measured through CUDA graphs on a GPU only: absent here, not 0
    for kind in ("device_seconds", "wait_seconds"):
        assert metric(server, "forge_decoder_engine_total", None, model="tensorrt_llm", kind=kind) is None


def seed_input(merged_repo, model="tensorrt_llm") -> str:
    """The seed input's name (``random_seed`` became ``seed`` in tensorrtllm_backend 1.0)."""
    from forge import tritonconfig

    names = {i.name for i in tritonconfig.read(merged_repo / model).input}
    return "seed" if "seed" in names else "random_seed"


def test_a_request_with_two_rows_gets_both_answers_padded(server, tokenizer, hf_model):
    """One Triton request carrying a batch of two prompts of different lengths and output lengths."""
    a, b = tokenizer.encode("hello world"), tokenizer.encode("What is machine learning? It is")
    ids = np.zeros((2, max(len(a), len(b))), np.int32)
    ids[0, : len(a)], ids[1, : len(b)] = a, b
    tensors = {"input_ids": ids, "input_lengths": np.array([[len(a)], [len(b)]], np.int32),
               "request_output_len": np.array([[5], [9]], np.int32), "pad_id": np.array([[7], [7]], np.int32)}
    result = infer(server, "tensorrt_llm", tensors)
    out, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert lengths.tolist() == [[len(a) + 5], [len(b) + 9]]
    assert out[0, 0, : len(a) + 5].tolist() == a + hf_greedy(hf_model, a, 5)
    assert out[1, 0].tolist() == b + hf_greedy(hf_model, b, 9)
    assert set(out[0, 0, len(a) + 5:].tolist()) <= {7}


def outputs_of(result) -> set[str]:
    return {output.name for output in result.get_response().outputs}


TIMINGS = {"arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns"}


def test_which_outputs_a_response_carries_follows_the_backend_version(server, tokenizer):
    """The executor-based backend (v0.14.0 on, the default v1.0.0 interface here) answers with output_ids and
    sequence_length, adds log probs, logits, timings and token counts only when the request asks for them and
    batch_index only for a request of several rows; v0.13.0 answers with every output, zero-filled."""
    ids = tokenizer.encode("hello world")
    plain = infer(server, "tensorrt_llm", llm_tensors(ids, 3))
    assert outputs_of(plain) == {"output_ids", "sequence_length"}
    flags = {name: np.array([[True]]) for name in ("return_log_probs", "return_context_logits",
                                                   "return_generation_logits", "return_perf_metrics",
                                                   "return_num_input_tokens", "return_num_output_tokens")}
    asked = infer(server, "tensorrt_llm", llm_tensors(ids, 3, **flags))
    assert outputs_of(asked) == {"output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "context_logits",
                                 "generation_logits", "num_input_tokens", "num_output_tokens"} | TIMINGS
    assert asked.as_numpy("num_input_tokens").tolist() == [[len(ids)]]
    assert asked.as_numpy("num_output_tokens").tolist() == [[3]]
    first, last = asked.as_numpy("first_token_time_ns")[0, 0], asked.as_numpy("last_token_time_ns")[0, 0]
    assert asked.as_numpy("arrival_time_ns")[0, 0] <= first <= last
    two = {"input_ids": np.array([ids, ids], np.int32), "input_lengths": np.array([[len(ids)]] * 2, np.int32),
           "request_output_len": np.array([[2], [2]], np.int32)}
    assert outputs_of(infer(server, "tensorrt_llm", two)) == {"output_ids", "sequence_length", "batch_index"}
    old = infer(server, "v13_tensorrt_llm", llm_tensors(ids, 3))
    assert {"cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index"} <= outputs_of(old)
    assert not old.as_numpy("output_log_probs").any() and old.as_numpy("context_logits").shape == (1, 1, 1)
    # streamed: every response carries the same outputs
    for response in stream(server, "s_tensorrt_llm", llm_tensors(ids, 3, streaming=np.array([[True]]))):
        assert outputs_of(response) == {"output_ids", "sequence_length"}


def test_per_request_sampling_seeds_and_stop_words(server, tokenizer, merged_repo):
    ids = tokenizer.encode("hello world")
    seed = seed_input(merged_repo)
    sampled = {"runtime_top_k": np.array([[40]], np.int32), "temperature": np.array([[1.3]], np.float32),
               seed: np.array([[11]], np.uint64)}
    first = infer(server, "tensorrt_llm", llm_tensors(ids, 12, **sampled)).as_numpy("output_ids")[0, 0].tolist()
    again = infer(server, "tensorrt_llm", llm_tensors(ids, 12, **sampled)).as_numpy("output_ids")[0, 0].tolist()
    assert first == again
    sampled[seed] = np.array([[12]], np.uint64)
    other = infer(server, "tensorrt_llm", llm_tensors(ids, 12, **sampled)).as_numpy("output_ids")[0, 0].tolist()
    assert other != first

    greedy = infer(server, "tensorrt_llm", llm_tensors(ids, 12)).as_numpy("output_ids")[0, 0].tolist()[len(ids):]
    stop = np.array([[[greedy[4]], [1]]], np.int32)
    stopped = infer(server, "tensorrt_llm", llm_tensors(ids, 12, stop_words_list=stop,
                                                        exclude_input_in_output=np.array([[True]])))
    assert stopped.as_numpy("output_ids")[0, 0].tolist() == greedy[: greedy.index(greedy[4]) + 1]


def test_stop_words_and_end_id_through_the_ensemble(server, tokenizer):
    status, body = generate(server, "ensemble", text_input="hello world", max_tokens=12)
    assert status == 200, body
    # A stop word the client can type: a generated token whose text is whole characters and
    # tokenizes back to that one token (a random model can emit partial UTF-8 sequences).
    ids = tokenizer.encode("hello world")
    greedy = infer(server, "tensorrt_llm", llm_tensors(ids, 12)).as_numpy("output_ids")[0, 0].tolist()[len(ids):]
    words = [tokenizer.decode([t]) for t in greedy]
    words = [w for t, w in zip(greedy, words)
             if w.strip() == w and w and "\ufffd" not in w and tokenizer.encode(w) == [t]]
    assert words, greedy
    word = words[0]
    status, stopped = generate(server, "ensemble", text_input="hello world", max_tokens=12, stop_words=word)
    assert status == 200, stopped
    assert stopped["text_output"].endswith(word) and len(stopped["text_output"]) <= len(body["text_output"])


# -- cancellation --------------------------------------------------------------------------------

# the engine inside the stub (s_) and in a process of its own (p_, -o engine_process=true)
BOTH_ENGINES = pytest.mark.parametrize("model", ["s_tensorrt_llm", "p_tensorrt_llm"])


# Not p_: there the tiny model's whole generation can end before the 100 ms cancel check sees the client go
# (one CI run); its cancel messages are covered by the stop-request test and the kill test below.
@pytest.mark.parametrize("model", ["s_tensorrt_llm"])
def test_client_cancellation_stops_generation(server, tokenizer, model):
    before = metric(server, "forge_decoder_finished_total", model=model, reason="cancelled")
    ids = tokenizer.encode("hello")
    responses = stream(server, model, llm_tensors(ids, MAX_SEQ_LEN - len(ids),
                                                  streaming=np.array([[True]])), cancel_after=2)
    assert len(responses) == 2
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(server, "forge_decoder_finished_total", model=model, reason="cancelled") > before:
            break
        time.sleep(0.1)
    assert metric(server, "forge_decoder_finished_total", model=model, reason="cancelled") == before + 1
    generated = metric(server, "forge_decoder_generated_tokens_total", model=model)
    time.sleep(0.5)
    assert metric(server, "forge_decoder_generated_tokens_total", model=model) == generated


@BOTH_ENGINES
def test_stop_request_ends_a_running_request(server, tokenizer, model):
    """TensorRT-LLM's ``stop`` input: a second request with the same id ends the first one early. The tiny model
    generates its whole budget in about a tenth of a second, so on a busy machine the stop can come too late: a
    few tries, each with its own id, and one must end early."""
    import tritonclient.grpc as grpc

    ids = tokenizer.encode("hello")
    budget = MAX_SEQ_LEN - len(ids)
    counts = []
    for attempt in range(5):
        client = grpc.InferenceServerClient(server.grpc_url)
        events: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        job = f"job-{attempt}"
        try:
            client.async_stream_infer(model, grpc_inputs(llm_tensors(ids, budget, streaming=np.array([[True]]))),
                                      request_id=job, enable_empty_final_response=True)
            tokens, stopped = 0, False
            while True:
                result, error = events.get(timeout=60)
                assert error is None, error
                response = result.get_response()
                if response.outputs:
                    tokens += result.as_numpy("output_ids").shape[-1]
                    if not stopped:
                        stream(server, model, llm_tensors(ids, 1, stop=np.array([[True]])), request_id=job)
                        stopped = True
                if response.parameters["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream()
            client.close()
        counts.append(tokens)
        assert tokens >= 1
        if tokens < budget:
            return
    pytest.fail(f"no stop request ended its request early in {len(counts)} tries (tokens: {counts}, budget {budget})")


# -- bad requests --------------------------------------------------------------------------------

@pytest.mark.parametrize("body, message", [
    (dict(text_input=PROMPT, max_tokens=0), "request_output_len must be at least 1"),  # max tokens ≤ 0
    (dict(text_input="hello " * 200, max_tokens=4), "max_input_len"),  # prompt longer than the context
    (dict(text_input=PROMPT, max_tokens=4, top_p=3.0), "runtime_top_p must be in [0, 1]"),
    (dict(text_input=PROMPT, max_tokens=4, beam_width=4), "beam"),
])
def test_bad_requests_get_an_error_and_the_server_keeps_serving(server, body, message):
    """Bad requests through the ensemble: max_tokens ≤ 0 / too large, prompt too long, bad sampling, beams."""
    status, answer = generate(server, "ensemble", **body)
    assert status == 400 and message in answer["error"]
    status, ok = generate(server, "ensemble", text_input=PROMPT, max_tokens=3)
    assert status == 200 and ok["text_output"].startswith(PROMPT)


def test_max_tokens_past_max_seq_len_is_shortened_as_tensorrt_llm_does(server):
    """Not an error in TensorRT-LLM either: the engine generates up to max_seq_len and logs a warning."""
    result = infer(server, "tensorrt_llm", llm_tensors([1, 2, 3], 5000))
    assert result.as_numpy("sequence_length").reshape(-1).tolist() == [MAX_SEQ_LEN]
    status, body = generate(server, "ensemble", text_input=PROMPT, max_tokens=5000)
    assert status == 200 and body["text_output"].startswith(PROMPT)


def test_empty_prompt_gets_an_error(server, tokenizer):
    """Bad request: an empty prompt (input_lengths 0) sent to the tensorrt_llm model."""
    from tritonclient.utils import InferenceServerException

    tensors = llm_tensors([0], 4)
    tensors["input_lengths"] = np.array([[0]], np.int32)
    with pytest.raises(InferenceServerException, match="the prompt is empty"):
        infer(server, "tensorrt_llm", tensors)


@pytest.mark.parametrize("tensors, message", [
    (dict(input_ids=np.array([[1, 2, 3]], np.int64)), "data-type is 'INT64'"),  # wrong dtype
    (dict(input_ids=np.array([[[1, 2, 3]]], np.int32)), "shape"),  # wrong shape
])
def test_wrong_dtypes_and_shapes_are_refused(server, tensors, message):
    """Bad requests: input_ids as INT64, input_ids with a third dimension."""
    from tritonclient.utils import InferenceServerException

    request = llm_tensors([1, 2, 3], 4)
    request.update(tensors)
    with pytest.raises(InferenceServerException, match=message):
        infer(server, "tensorrt_llm", request)
    assert infer(server, "tensorrt_llm", llm_tensors([1, 2, 3], 2)).as_numpy("output_ids").shape == (1, 1, 5)


# -- backend profiles ------------------------------------------------------------------------------

def test_v0_5_0_repository_answers_a_uint32_max_tokens_client(server, tokenizer):
    tensors = {"text_input": np.array([[PROMPT.encode()]], object), "max_tokens": np.array([[6]], np.uint32),
               "bad_words": np.array([[b""]], object), "stop_words": np.array([[b""]], object)}
    result = infer(server, "v5_ensemble", tensors)
    text = result.as_numpy("text_output").reshape(-1)[0].decode()
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    status, body = generate(server, "v5_ensemble", text_input=PROMPT, max_tokens=6, bad_words="", stop_words="")
    assert status == 200 and body["text_output"] == text


def test_hf_pipeline_target_answers_like_transformers_and_refuses_word_lists(server, tokenizer, hf_model):
    """--target hf-pipeline: seed 000's model, reached like an ensemble; greedy = transformers generate."""
    status, body = generate(server, "hf_ensemble", text_input=PROMPT, max_tokens=6, bad_words="", stop_words="")
    ids = tokenizer(PROMPT).input_ids
    assert status == 200 and body["text_output"] == tokenizer.decode(ids + hf_greedy(hf_model, ids, 6))
    status, body = generate(server, "hf_ensemble", text_input=PROMPT, max_tokens=6, exclude_input_in_output=True)
    assert status == 200 and body["text_output"] == tokenizer.decode(hf_greedy(hf_model, ids, 6))
    status, body = generate(server, "hf_ensemble", text_input=PROMPT, max_tokens=6, stop_words="learning")
    assert status == 400 and "stop_words is not supported by the hf-pipeline target" in body["error"]


def test_python_model_has_exactly_the_tensorrt_llm_interface_of_its_profile(merged_repo):
    from forge import tritonconfig
    from forge import profiles

    from forge.in_triton import forge_llmapi

    for prefix, version in (("", "v1.2.1"), ("l_", profiles.NEWEST), ("v5_", "v0.5.0")):
        config = tritonconfig.read(merged_repo / f"{prefix}tensorrt_llm")
        interface = profiles.resolve(version).interface("tensorrt_llm")
        # the LLM-API layout adds forge's optional inputs and outputs after TensorRT-LLM's own
        extra_in = [n for n, _, _ in forge_llmapi.EXTENSION_INPUTS] if prefix == "l_" else []
        extra_out = [n for n, _, _ in forge_llmapi.EXTENSION_OUTPUTS] if prefix == "l_" else []
        assert config.backend == "python"
        assert [i.name for i in config.input] == [t.name for t in interface.inputs] + extra_in
        assert [o.name for o in config.output] == [t.name for t in interface.outputs] + extra_out


# -- the engine in a process of its own (-o engine_process=true: p_ models) ------------------------------

def _outputs(result) -> dict:
    response = result.get_response()
    return {o.name: result.as_numpy(o.name).tolist() for o in response.outputs}


def _timeless(outputs: dict) -> dict:
    """Outputs without the ones that hold times (arrival, first token ...) or their differences."""
    return {k: v for k, v in outputs.items() if "time" not in k and "_ns" not in k and "latency" not in k}


def test_the_engine_in_its_own_process_answers_like_the_engine_in_the_stub(server, tokenizer, hf_model):
    """Every output tensor equal to the same request served with the engine inside the stub (s_), non-streamed
    and streamed, with log-probabilities and context / generation logits asked for; greedy = transformers."""
    ids = tokenizer.encode("The capital of France is")
    extra = {name: np.array([[True]]) for name in ("return_log_probs", "return_context_logits",
                                                    "return_generation_logits")}
    for streaming in (False, True):
        asked = llm_tensors(ids, 12, streaming=np.array([[streaming]]), **extra)
        hosted, inside = stream(server, "p_tensorrt_llm", asked), stream(server, "s_tensorrt_llm", asked)
        assert len(hosted) == len(inside) == (12 if streaming else 1)
        for mine, theirs in zip(hosted, inside):
            assert _timeless(_outputs(mine)) == _timeless(_outputs(theirs))
    (single,) = stream(server, "p_tensorrt_llm", llm_tensors(ids, 24))
    assert single.as_numpy("output_ids")[0, 0].tolist() == ids + hf_greedy(hf_model, ids, 24)


def test_the_engine_process_serves_concurrent_requests_and_the_ensemble(server, tokenizer, hf_model):
    prompts = ["hello", "What is machine learning? " * 3, "a quick brown fox", "hello world " * 5]
    lengths = [3, 17, 8, 30]
    results: dict[int, list[int]] = {}

    def ask(index, ids, n):
        (result,) = stream(server, "p_tensorrt_llm", llm_tensors(ids, n))
        results[index] = result.as_numpy("output_ids")[0, 0].tolist()

    jobs = [(tokenizer.encode(p), n) for p, n in zip(prompts, lengths)]
    threads = [threading.Thread(target=ask, args=(i, ids, n)) for i, (ids, n) in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == {i: ids + hf_greedy(hf_model, ids, n) for i, (ids, n) in enumerate(jobs)}
    tensors = {"text_input": np.array([[PROMPT.encode()]], object), "max_tokens": np.array([[10]], np.int32),
               "stream": np.array([[True]])}
    mine = [r.as_numpy("text_output").reshape(-1)[0] for r in stream(server, "p_ensemble", tensors)]
    theirs = [r.as_numpy("text_output").reshape(-1)[0] for r in stream(server, "s_ensemble", tensors)]
    assert mine == theirs and len(mine) == 10


def test_streams_that_outpace_the_sender_get_every_token_since_their_last_response(server, tokenizer):
    """One sender thread (``p1_``) and 32 streams of 40 tokens: the engine process makes tokens faster than one
    thread sends responses, so a lagging stream's next response carries every token since its last instead of
    the engine waiting. Each stream's pieces still add up to its non-streamed answer, in order, the last one
    final; a lone stream still gets one response a token."""
    prompts = [tokenizer.encode(f"hello world {i} " * (1 + i % 4)) for i in range(32)]
    answers = {i: stream(server, "p1_tensorrt_llm", llm_tensors(ids, 40))[0].as_numpy("output_ids")[0, 0].tolist()
               for i, ids in enumerate(prompts)}
    pieces: dict[int, list] = {}

    def ask(index: int) -> None:
        pieces[index] = stream(server, "p1_tensorrt_llm", llm_tensors(prompts[index], 40,
                                                                       streaming=np.array([[True]])))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(pieces) == list(range(32))
    for i, responses in pieces.items():
        ids = [t for r in responses for t in r.as_numpy("output_ids").reshape(-1).tolist()]
        assert prompts[i] + ids == answers[i], i
    assert sum(len(responses) for responses in pieces.values()) < 32 * 40  # some carried several tokens
    alone = stream(server, "p1_tensorrt_llm", llm_tensors(prompts[0], 12, streaming=np.array([[True]])))
    assert [r.as_numpy("output_ids").size for r in alone] == [1] * 12


@pytest.mark.parametrize("extra, message", [
    ({"guided_decoding_guide_type": np.array([["regex".encode()]], object),
      "guided_decoding_guide": np.array([["([a-z]".encode()]], object)}, "guided_decoding_guide"),
    ({"lora_task_id": np.array([[3]], np.uint64)}, "LoRA task 3 not found in cache"),
])
def test_what_the_engine_process_refuses_is_one_error_and_it_keeps_serving(server, tokenizer, extra, message):
    """Bad inputs tried: an invalid regex guide (or guided decoding unavailable), a LoRA task id never sent
    with its weights; both are resolved in the engine process and answered as the stub's engine answers."""
    ids = tokenizer.encode("hello")
    for model in ("p_tensorrt_llm", "s_tensorrt_llm"):
        error = first_error(server, model, llm_tensors(ids, 4, **extra))
        assert error is not None and message in str(error), (model, error)
    (result,) = stream(server, "p_tensorrt_llm", llm_tensors(ids, 4))
    assert result.as_numpy("output_ids").shape[-1] == len(ids) + 4


def test_short_requests_under_the_cancel_watcher_never_crash_the_server(server):
    """The engine process's cancel watcher asks each live request whether its client went away (every 5 ms for
    p_). A request whose final response was sent meanwhile must not be asked: tritonserver has freed its response
    factory and segfaulted (TRITONBACKEND_ResponseFactoryIsCancelled) within about 550 such requests here."""
    import tritonclient.grpc as grpc

    done, errors = [0], []
    stop = time.monotonic() + 6.0

    def client_loop():
        client = grpc.InferenceServerClient(server.grpc_url)
        events: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        try:
            while time.monotonic() < stop and not errors:
                client.async_stream_infer("p_tensorrt_llm", grpc_inputs(llm_tensors([1, 2, 3, 4], 2)),
                                          enable_empty_final_response=True)
                while True:
                    result, error = events.get(timeout=30)
                    if error is not None:
                        errors.append(str(error))
                        return
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        break
                done[0] += 1
        finally:
            client.stop_stream()
            client.close()

    threads = [threading.Thread(target=client_loop) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and server.process.poll() is None, (errors[:1], done[0])
    assert done[0] > 550


def first_error(server, model, tensors, timeout=60.0):
    """The error of one streamed request's first response (None: it had none)."""
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(server.grpc_url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(model, grpc_inputs(tensors))
        return events.get(timeout=timeout)[1]
    finally:
        client.stop_stream()
        client.close()


def test_zz_a_killed_engine_process_fails_its_requests_in_bounded_time(server, tokenizer):
    """kill -9 of the engine process while a request streams: that request gets an error naming the exit
    within seconds, and later requests to the model get the same error at once (the other models serve on).
    The last test of this file: the p_ model answers nothing after it."""
    import os
    import signal

    import tritonclient.grpc as grpc

    from forge.server.processes import engine_model, engine_processes, repository_processes

    (pid,) = [pid for pid in engine_processes(repository_processes(server.repo))
              if engine_model(pid) == "p_tensorrt_llm"]
    ids = tokenizer.encode("hello")
    client = grpc.InferenceServerClient(server.grpc_url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer("p_tensorrt_llm", grpc_inputs(llm_tensors(ids, MAX_SEQ_LEN - len(ids),
                                                                            streaming=np.array([[True]]))))
        result, error = events.get(timeout=60)
        assert error is None, error
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        while error is None:
            result, error = events.get(timeout=30)
        assert "the engine process exited with status -9" in str(error) and time.monotonic() - started < 10
    finally:
        client.stop_stream()
        client.close()
    error = first_error(server, "p_tensorrt_llm", llm_tensors(ids, 4), timeout=30)
    assert error is not None and "the engine process exited with status -9" in str(error)
    (result,) = stream(server, "s_tensorrt_llm", llm_tensors(ids, 4))
    assert result.as_numpy("output_ids").shape[-1] == len(ids) + 4
