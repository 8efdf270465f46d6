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

    from forge.in_triton import forge_text

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


def _call(client, model, tensors, outputs):
    import tritonclient.http as http

    inputs = []
    for name, value in tensors.items():
        dtype = "BYTES" if value.dtype == object else {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
                                                        np.dtype(np.bool_): "BOOL"}[value.dtype]
        tensor = http.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = client.infer(model, inputs, outputs=[http.InferRequestedOutput(o) for o in outputs])
    return [result.as_numpy(o) for o in outputs]


def _decoder_inputs(client, prompt: str, image: bytes | None) -> dict:
    """The ensemble's route by hand up to tensorrt_llm: multimodal_encoders, then preprocessing."""
    query = np.array([[prompt.encode()]], dtype=object)
    table = {}
    if image is not None:  # a text-only request gets no table (multimodal_encoders answers without outputs)
        values = _call(client, "multimodal_encoders", {"QUERY": query, "IMAGE": np.array([[image]], dtype=object)},
                       ["OUT_PROMPT_EMBEDDING_TABLE", "OUT_PROMPT_VOCAB_SIZE"])
        table = {"prompt_embedding_table": values[0].astype(np.float32),
                 "prompt_vocab_size": values[1].astype(np.int32)}
    rows = {"PROMPT_VOCAB_SIZE": table["prompt_vocab_size"]} if table else {}
    length = np.array([[NEW_TOKENS]], dtype=np.int32)
    ids, lengths = _call(client, "preprocessing", {"QUERY": query, "REQUEST_OUTPUT_LEN": length, **rows},
                         ["INPUT_ID", "REQUEST_INPUT_LEN"])
    return {"input_ids": ids.astype(np.int32), "input_lengths": lengths.astype(np.int32),
            "request_output_len": length, **table}


def test_token_ids_equal_transformers_generate(tiny_llava, llava_server):
    """The ensemble's route by hand (encoders → preprocessing → tensorrt_llm): output ids = generate's."""
    client = _client(llava_server)
    tensors = _decoder_inputs(client, PROMPT, png(1))
    rows = tensors["prompt_vocab_size"].reshape(-1)[0]
    assert rows == _visual(tiny_llava) == tensors["prompt_embedding_table"].shape[1]
    (output,) = _call(client, "tensorrt_llm", tensors, ["output_ids"])
    expected, _ = _reference(tiny_llava, PROMPT, png(1))
    assert output.reshape(-1)[: len(expected)].tolist() == expected


def test_each_image_keys_its_own_kv_cache_blocks(llava_server):
    """OUT_PROMPT_TABLE_EXTRA_ID: the same image the same id, another image another one, never 0."""
    client = _client(llava_server)
    query = np.array([[PROMPT.encode()]], dtype=object)

    def key(image):
        (value,) = _call(client, "multimodal_encoders", {"QUERY": query, "IMAGE": np.array([[image]], dtype=object)},
                         ["OUT_PROMPT_TABLE_EXTRA_ID"])
        return int(value.reshape(-1)[0])

    assert key(png(1)) == key(png(1)) != key(png(2))
    assert key(png(1)) > 0 and key(base64.b64encode(png(1))) == key(png(1))


def test_streamed_token_ids_of_a_mixed_batch_equal_transformers(tiny_llava, llava_server):
    """Image and text-only requests streamed together from the decoupled tensorrt_llm: each one's ids = generate's."""
    from forge.clients.inference import GrpcSession

    client = _client(llava_server)
    jobs = [(PROMPT, png(1)), (TEXT_PROMPT, None), (PROMPT, png(2)), ("USER: <image>\nDescribe it. ASSISTANT:", png(3))]
    requests = [_decoder_inputs(client, prompt, image) for prompt, image in jobs]

    def stream(tensors):
        with GrpcSession(llava_server.grpc_url) as session:
            tensors = {**tensors, "streaming": np.array([[True]])}
            return [e.outputs["output_ids"].reshape(-1).tolist() for e in session.stream("s_tensorrt_llm", tensors)
                    if "output_ids" in e.outputs]

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(stream, requests))
    for (prompt, image), steps in zip(jobs, results):
        assert len(steps) > 1
        assert [t for step in steps for t in step] == _reference(tiny_llava, prompt, image)[0]


def test_generate_endpoint_takes_a_base64_image(tiny_llava, llava_server):
    """HTTP generate: ``image`` as a base64 string (the JSON form of BYTES)."""
    image = png(5)
    body = json.dumps({"text_input": PROMPT, "max_tokens": NEW_TOKENS,
                       "image": base64.b64encode(image).decode()}).encode()
    host = llava_server.http_url.split("://")[-1]
    request = urllib.request.Request(f"http://{host}/v2/models/ensemble/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())["text_output"]
    assert answer == _reference(tiny_llava, PROMPT, image)[1]


def test_backend_v0_13_0_repository_answers_like_transformers(tiny_llava, llava_server):
    """The v0.13.0 profile's interface (FP16 prompt table, prompt_table_extra_id): image and text-only prompts."""
    client = _client(llava_server)
    for prompt, image in ((PROMPT, png(1)), (TEXT_PROMPT, None)):
        assert _text(client.infer("v13_ensemble", _inputs(prompt, image))) == _reference(tiny_llava, prompt, image)[1]


def test_placeholder_and_image_must_go_together(llava_server):
    client = _client(llava_server)
    with pytest.raises(Exception, match="no image was sent"):
        client.infer("ensemble", _inputs(PROMPT, None))
    with pytest.raises(Exception, match="placeholder <image> exactly once"):
        client.infer("ensemble", _inputs(TEXT_PROMPT, png(1)))
    with pytest.raises(Exception, match="empty"):
        client.infer("ensemble", _inputs(PROMPT, b""))
    assert _text(client.infer("ensemble", _inputs(TEXT_PROMPT, None)))  # still serving


def test_streaming_ensemble_with_images(tiny_llava, llava_server):
    """The decoupled ensemble streams image and text-only requests in flight together."""
    from forge.clients.inference import GrpcSession, text_of, text_request

    jobs = [(PROMPT, png(1)), (TEXT_PROMPT, None), (PROMPT, png(2))]

    def stream(job):
        prompt, image = job
        with GrpcSession(llava_server.grpc_url) as session:
            inputs = session.config("s_ensemble")
            tensors = text_request(inputs, prompt, NEW_TOKENS, stream=True, image=image)
            pieces = [text_of(e.outputs["text_output"]) for e in session.stream("s_ensemble", tensors)
                      if "text_output" in e.outputs]
        return pieces

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(stream, jobs))
    for pieces in results:  # streamed pieces decode in context, so only their number is compared here
        assert len(pieces) == NEW_TOKENS or 1 < len(pieces) < NEW_TOKENS  # one per token (fewer at an end id)


def test_infer_and_bench_send_images(tiny_llava, llava_server, tmp_path, capsys):
    """``forge infer --image`` answers like transformers; ``forge bench --image`` measures image requests."""
    image = tmp_path / "photo.png"
    image.write_bytes(png(1))
    url = llava_server.http_url.split("://", 1)[-1]
    assert forge_cli("infer", "--url", url, "--image", str(image), PROMPT, "--max-tokens", str(NEW_TOKENS)) == 0
    assert capsys.readouterr().out.rstrip("\n") == _reference(tiny_llava, PROMPT, png(1))[1]
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert forge_cli("infer", "--url", url, "--image", str(bad), PROMPT) == 1
    assert "not a decodable image" in capsys.readouterr().err
    assert forge_cli("infer", "--url", url, "--image", str(tmp_path / "missing.png"), PROMPT) == 2
    assert forge_cli("bench", llava_server.grpc_url.split("://", 1)[-1], "--image", str(image), "--json",
                     "--concurrency", "2", "prompts", "--prompt", "What is this?", "--num-requests", "4",
                     "--output-len", "4") == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["model"], result["succeeded"], result["errors"]) == ("ensemble", 4, 0)
    assert result["images"] == [str(image)] and result["output_tokens"] > 0


def forge_cli(*argv: str) -> int:
    from forge.cli import main

    return main(list(argv))


def test_openai_chat_answers_an_image_url_as_the_generate_endpoint_does(llava_server, served_repo):
    """A data: URL image part: the placeholder goes where the part is, the answer equals generate's; an http URL
    and bytes that are not an image are refused with 400 naming why."""
    openai = pytest.importorskip("openai")
    from forge.openai_front import OpenAIServer

    front = OpenAIServer(served_repo, llava_server.grpc_url, port=0).start()
    try:
        api = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=300)
        image = png(1)
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is this?"}]}]
        answer = api.chat.completions.create(model=served_repo.name, messages=messages, max_tokens=NEW_TOKENS,
                                             temperature=0)
        expected = _text(_client(llava_server).infer("ensemble", _inputs(PROMPT, image)))
        assert answer.choices[0].message.content == expected.removeprefix(PROMPT)
        assert answer.usage.prompt_tokens > _visual_prompt_floor()
        for bad, words in (("https://example.com/cat.png", "fetches nothing"),
                           ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a decodable")):
            broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad}},
                                                   {"type": "text", "text": "What is this?"}]}]
            with pytest.raises(openai.BadRequestError, match=words):
                api.chat.completions.create(model=served_repo.name, messages=broken, max_tokens=2)
    finally:
        front.stop()


def _visual_prompt_floor() -> int:
    """More prompt tokens than the text alone: the image's rows of the prompt table count too."""
    return len(PROMPT.split())
