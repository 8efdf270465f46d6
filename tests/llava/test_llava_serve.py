"""--target python served by the real tritonserver: image questions answered with transformers' tokens."""

from __future__ import annotations

import base64
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tiny_llava import png, reference_generate

pytestmark = pytest.mark.heavy

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
TEXT_PROMPT = "USER: What is this? ASSISTANT:"
NEW_TOKENS = 8


def _client(server):
    import tritonclient.http as http

    return http.InferenceServerClient(server.http_url.split("://", 1)[-1], concurrency=8)


def _inputs(prompt: str, image: bytes | None, max_tokens: int = NEW_TOKENS):
    import tritonclient.http as http

    tensors = {"text_input": np.array([[prompt.encode()]], dtype=object),
               "max_tokens": np.array([[max_tokens]], dtype=np.int32)}
    if image is not None:
        tensors["image"] = np.array([[image]], dtype=object)
    result = []
    for name, value in tensors.items():
        tensor = http.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "INT32")
        tensor.set_data_from_numpy(value)
        result.append(tensor)
    return result


def _text(result) -> str:
    return result.as_numpy("text_output").reshape(-1)[0].decode()


def _visual(model) -> int:
    from transformers import LlavaConfig

    from tiny_llava import visual_tokens

    return visual_tokens(LlavaConfig.from_pretrained(model))


def _reference(model, prompt: str, image: bytes | None) -> tuple[list[int], str]:
    """transformers' greedy new token ids and their text (decoded as the served postprocessing decodes)."""
    from transformers import AutoTokenizer

    from forge.served import forge_text

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = reference_generate(model, prompt, image, NEW_TOKENS)
    prompt_len = len(tokenizer(prompt)["input_ids"]) + ((_visual(model) - 1) if image is not None else 0)
    new = ids[prompt_len:]
    return new, forge_text.decode(tokenizer, new, True)


def test_image_questions_match_transformers_in_one_concurrent_batch(tiny_llava, llava_server):
    """Several images, a text-only prompt and a bad image in flight together; each answer is transformers'."""
    client = _client(llava_server)
    jobs = [(PROMPT, png(1)), (PROMPT, png(2)), ("USER: <image>\nDescribe it. ASSISTANT:", png(3)),
            (TEXT_PROMPT, None), (PROMPT, b"\x89PNG\r\n\x1a\n not really a png")]
    pending = [client.async_infer("ensemble", _inputs(prompt, image)) for prompt, image in jobs]
    answers = []
    for request in pending:
        try:
            answers.append(_text(request.get_result()))
        except Exception as exc:  # noqa: BLE001 - the bad image's error is the expected answer
            answers.append(exc)
    for (prompt, image), answer in list(zip(jobs, answers))[:4]:
        assert answer == _reference(tiny_llava, prompt, image)[1], (prompt, image is not None)
    assert "not a decodable image" in str(answers[4])
    assert answers[0] != answers[1]  # the image reaches the answer
    # the server keeps serving after the bad image
    assert _text(client.infer("ensemble", _inputs(PROMPT, png(1)))) == answers[0]


def test_token_ids_equal_transformers_generate(tiny_llava, llava_server):
    """The ensemble's route by hand (encoders → preprocessing → tensorrt_llm): output ids = generate's."""
    import tritonclient.http as http

    client = _client(llava_server)
    image = png(1)
    query = np.array([[PROMPT.encode()]], dtype=object)

    def call(model, tensors, outputs):
        inputs = []
        for name, value in tensors.items():
            dtype = {object: "BYTES", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}[
                object if value.dtype == object else value.dtype]
            tensor = http.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        result = client.infer(model, inputs, outputs=[http.InferRequestedOutput(o) for o in outputs])
        return [result.as_numpy(o) for o in outputs]

    table, rows = call("multimodal_encoders", {"IMAGE": np.array([[image]], dtype=object), "QUERY": query},
                       ["OUT_PROMPT_EMBEDDING_TABLE", "OUT_PROMPT_VOCAB_SIZE"])
    assert rows.reshape(-1)[0] == _visual(tiny_llava) == table.shape[1]
    ids, lengths = call("preprocessing", {"QUERY": query, "PROMPT_VOCAB_SIZE": rows.astype(np.int32)},
                        ["INPUT_ID", "REQUEST_INPUT_LEN"])
    (output,) = call("tensorrt_llm", {"input_ids": ids.astype(np.int32), "input_lengths": lengths.astype(np.int32),
                                      "request_output_len": np.array([[NEW_TOKENS]], dtype=np.int32),
                                      "prompt_embedding_table": table.astype(np.float32),
                                      "prompt_vocab_size": rows.astype(np.int32)}, ["output_ids"])
    expected, _ = _reference(tiny_llava, PROMPT, image)
    assert output.reshape(-1)[: len(expected)].tolist() == expected


def test_generate_endpoint_takes_a_base64_image(tiny_llava, llava_server):
    """HTTP generate: ``image`` as a base64 string (the JSON form of BYTES)."""
    image = png(5)
    body = json.dumps({"text_input": PROMPT, "max_tokens": NEW_TOKENS,
                       "image": base64.b64encode(image).decode()}).encode()
    request = urllib.request.Request(f"http://{llava_server.http_url.split('://')[-1]}/v2/models/ensemble/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())["text_output"]
    assert answer == _reference(tiny_llava, PROMPT, image)[1]


def test_placeholder_and_image_must_go_together(llava_server):
    client = _client(llava_server)
    with pytest.raises(Exception, match="no image was sent"):
        client.infer("ensemble", _inputs(PROMPT, None))
    with pytest.raises(Exception, match="placeholder <image> exactly once"):
        client.infer("ensemble", _inputs(TEXT_PROMPT, png(1)))
    with pytest.raises(Exception, match="empty"):
        client.infer("ensemble", _inputs(PROMPT, b""))
    assert _text(client.infer("ensemble", _inputs(TEXT_PROMPT, None)))  # still serving
