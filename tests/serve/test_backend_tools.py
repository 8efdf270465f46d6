"""tensorrtllm_backend's own client tools, mirrored: each test sends what one tool sends and checks what it reads.

The tools cannot be downloaded in CI and their code stays out of this project, so each test names the tool
and the release it mirrors (tensorrtllm_backend tags; "newest" is the copy in TensorRT-LLM's
``triton_backend/`` tree) and repeats its requests and the reads that failed against forge before:
``text_output[0].decode()`` (a flat ``[batch * beams]`` text tensor), the log-prob and logits outputs
the backend always returns, preprocessing's placeholder outputs, and random token ids past the vocabulary.
Model names carry the session server's prefixes (see conftest.py): ``v13_`` is a v0.13.0 build with the
BLS model, ``s_`` the newest profile with ``--decoupled``, no prefix the newest profile.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest

from test_python_target import grpc_inputs, infer

pytestmark = pytest.mark.heavy

PROMPT = "What is machine learning?"


def grpc_stream(server, model, tensors, outputs=None):
    """What the end_to_end_grpc_client does: start_stream, async_stream_infer, stop_stream, read the queue."""
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error or result))
    requested = [grpc.InferRequestedOutput(name) for name in outputs] if outputs else None
    client.async_stream_infer(model, grpc_inputs(tensors), outputs=requested, request_id="")
    client.stop_stream()  # waits for the server to close the stream
    client.close()
    answers = []
    while not results.empty():
        answers.append(results.get())
    for answer in answers:
        assert not isinstance(answer, Exception), answer
    return answers


def client_inputs(streaming: bool, newest: bool) -> dict[str, np.ndarray]:
    """end_to_end_grpc_client.py's prepare_inputs for ``-p PROMPT -o 8`` (with ``-S`` when streaming)."""
    tensors = {"text_input": np.array([[PROMPT]]).astype(object),
               "max_tokens": np.ones((1, 1), np.int32) * 8,
               "stream": np.array([[streaming]], dtype=bool),
               "beam_width": np.array([[1]], dtype=np.int32),
               "temperature": np.array([[1.0]], dtype=np.float32)}
    if newest:
        tensors["num_return_sequences"] = np.array([[1]], dtype=np.int32)
        tensors["exclude_input_in_output"] = np.array([[False]], dtype=bool)
    return tensors


def test_end_to_end_grpc_client_v0_13_0(server):
    """inflight_batcher_llm/client/end_to_end_grpc_client.py (v0.13.0) -p PROMPT -o 8: every output requested."""
    (result,) = grpc_stream(server, "v13_ensemble", client_inputs(streaming=False, newest=False))
    batch_index = result.as_numpy("batch_index")[0][0]
    text = result.as_numpy("text_output")[batch_index].decode("utf-8")
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)


def test_end_to_end_grpc_client_newest(server):
    """end_to_end_grpc_client.py (newest) -p PROMPT -o 8: only text_output requested, batch_index may be absent."""
    (result,) = grpc_stream(server, "ensemble", client_inputs(streaming=False, newest=True), outputs=["text_output"])
    output = result.as_numpy("text_output")
    assert output.shape == (1,) and result.as_numpy("batch_index") is None
    assert output[0].decode("utf-8").startswith(PROMPT)


def test_end_to_end_grpc_client_newest_streaming(server):
    """end_to_end_grpc_client.py (newest) -S against a --decoupled build: one text piece per response."""
    results = grpc_stream(server, "s_ensemble", client_inputs(streaming=True, newest=True), outputs=["text_output"])
    pieces = [r.as_numpy("text_output") for r in results if r.as_numpy("text_output") is not None]
    assert len(pieces) == 8
    assert all(p.shape == (1,) for p in pieces)
    text = "".join(p[0].decode("utf-8") for p in pieces)  # what the tool prints: each piece decodes on its own
    assert text


def end_to_end_test_inputs(model, prompt, output_len, logits):
    """tools/inflight_batcher_llm/end_to_end_test.py (v0.13.0) inputs of the ensemble or BLS model."""
    tensors = {"text_input": np.array([[prompt]]).astype(object),
               "max_tokens": np.ones((1, 1), np.int32) * output_len,
               "bad_words": np.array([[""]], dtype=object), "stop_words": np.array([[""]], dtype=object)}
    if logits:
        tensors["return_context_logits"] = np.array([[True]], dtype=bool)
        tensors["return_generation_logits"] = np.array([[True]], dtype=bool)
    return tensors


@pytest.mark.parametrize("logits", [False, True], ids=["plain", "return-logits"])
def test_end_to_end_test_v0_13_0_with_bls(server, tiny_gpt2, logits):
    """tools/inflight_batcher_llm/end_to_end_test.py (v0.13.0) --test-bls [--return-context-logits
    --return-generation-logits]: preprocessing → tensorrt_llm → postprocessing by hand, then the ensemble and
    the BLS model, compared the way the tool compares them."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_gpt2)).vocab_size
    prompt, output_len = "The capital of France is", 6
    pre = infer(server, "v13_preprocessing", {
        "QUERY": np.array([[prompt]]).astype(object), "BAD_WORDS_DICT": np.array([[""]], dtype=object),
        "STOP_WORDS_DICT": np.array([[""]], dtype=object),
        "REQUEST_OUTPUT_LEN": np.ones((1, 1), np.int32) * output_len})
    input_ids = pre.as_numpy("INPUT_ID")
    llm_in = {"input_ids": input_ids, "decoder_input_ids": pre.as_numpy("DECODER_INPUT_ID"),
              "input_lengths": pre.as_numpy("REQUEST_INPUT_LEN"), "request_output_len": pre.as_numpy("REQUEST_OUTPUT_LEN"),
              "end_id": pre.as_numpy("OUT_END_ID"), "pad_id": pre.as_numpy("OUT_PAD_ID")}
    if logits:
        llm_in["return_context_logits"] = np.array([[True]], dtype=bool)
        llm_in["return_generation_logits"] = np.array([[True]], dtype=bool)
    llm = infer(server, "v13_tensorrt_llm", llm_in)
    tokens = llm.as_numpy("output_ids").astype(np.int32)
    cum_log_probs = llm.as_numpy("cum_log_probs").astype(np.float32)
    output_log_probs = llm.as_numpy("output_log_probs").astype(np.float32)
    context_logits = llm.as_numpy("context_logits").astype(np.float32)
    generation_logits = llm.as_numpy("generation_logits").astype(np.float32)
    post = infer(server, "v13_postprocessing", {
        "TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": llm.as_numpy("sequence_length"), "CUM_LOG_PROBS": cum_log_probs,
        "OUTPUT_LOG_PROBS": output_log_probs, "CONTEXT_LOGITS": context_logits, "GENERATION_LOGITS": generation_logits})
    text = post.as_numpy("OUTPUT")
    assert np.allclose(generation_logits, post.as_numpy("OUT_GENERATION_LOGITS"), 1e-2, 1e-2)

    for model in ("v13_ensemble", "v13_tensorrt_llm_bls"):
        result = infer(server, model, end_to_end_test_inputs(model, prompt, output_len, logits))
        assert text == result.as_numpy("text_output")
        assert cum_log_probs == result.as_numpy("cum_log_probs")
        assert (output_log_probs == result.as_numpy("output_log_probs")).all()
        assert np.allclose(context_logits, result.as_numpy("context_logits"), 1e-2, 1e-2)
        assert np.allclose(generation_logits, result.as_numpy("generation_logits"), 1e-2, 1e-2)
        context, generation = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
        if logits:
            assert context.shape == (1, input_ids.size, vocab)
            assert generation.shape == (1, 1, output_len, vocab)
        else:  # the backend's placeholders
            assert context.shape == (1, 1, 1) and context[0][0][0] == 0
            assert generation.shape == (1, 1, 1, 1) and generation[0][0][0][0] == 0


def core_model_inputs(ids: np.ndarray, output_len: int) -> dict[str, np.ndarray]:
    """tools/inflight_batcher_llm/benchmark_core_model.py's request to tensorrt_llm."""
    return {"input_ids": ids, "input_lengths": np.array([[ids.shape[1]]], np.int32),
            "request_output_len": np.ones_like([[1]]).astype(np.int32) * output_len}


def test_benchmark_core_model_token_norm_dist_ids_outside_the_vocabulary(server):
    """benchmark_core_model.py (v0.13.0) token-norm-dist: random ids in [0, 2**31 - 1), warm-up asking for 100
    tokens (past max_seq_len: shortened, as the engine does), then the measured requests, plain and decoupled."""
    rng = np.random.default_rng(0)
    ids = np.array([rng.integers(0, np.iinfo(np.int32).max, size=16, dtype=np.int32)])
    warm = infer(server, "tensorrt_llm", core_model_inputs(ids, 100))
    assert warm.as_numpy("output_ids").shape[-1] > ids.shape[1]
    for model in ("tensorrt_llm", "v13_tensorrt_llm"):
        result = infer(server, model, core_model_inputs(ids, 5))
        assert result.as_numpy("output_ids").shape[-1] == ids.shape[1] + 5
    streamed = grpc_stream(server, "s_tensorrt_llm", dict(core_model_inputs(ids, 5), streaming=np.array([[True]])))
    assert sum(r.as_numpy("output_ids").shape[-1] for r in streamed if r.as_numpy("output_ids") is not None) == 5
