"""forge's preprocessing, postprocessing, ensemble and BLS answering on the real tritonserver.

The C++ tensorrt_llm model cannot run here (no GPU, no TensorRT); where a test needs generation it
puts ``engine_double.generating_model`` in its place: the same tensor interface, a fixed continuation.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest

import engine_double
import helpers
from forge import profiles

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

pytestmark = pytest.mark.heavy

PROMPT = "The capital of France is"
CONTINUATION = "Paris. héllo 日本語 🙂 naïve"  # multi-byte characters arrive as byte-fallback tokens


def _tokenizer(path):
    from forge.in_triton import forge_text

    return forge_text.load_tokenizer(str(path))


def _bytes_input(http, name, values):
    tensor = http.InferInput(name, list(values.shape), "BYTES")
    tensor.set_data_from_numpy(values)
    return tensor


def _input(http, name, values, dtype):
    tensor = http.InferInput(name, list(values.shape), dtype)
    tensor.set_data_from_numpy(values)
    return tensor


@pytest.fixture(scope="module")
def text_repo(tokenizer_dirs, tmp_path_factory):
    """Only forge's preprocessing and postprocessing (of a streaming build), for both tokenizer styles."""
    root = tmp_path_factory.mktemp("text-repo")
    out = root / "repo"
    for kind, prefix in (("byte_level", "bl_"), ("sentencepiece", "sp_")):
        models, _, _, _ = helpers.emit(tokenizer_dirs[kind], out, root / kind, prefix=prefix,
                                       options={"decoupled": True})
        kept = {name: m for name, m in models.items() if not name.endswith("tensorrt_llm")}
        assert helpers.write(kept, [], out) == []
    return out


def ascii_of(text: str) -> str:
    """The single-byte characters of ``text``: never split across tokens, so streaming keeps them exactly."""
    return "".join(c for c in text if c.isascii())


def test_preprocessing_and_postprocessing_answer(text_repo, tokenizer_dirs):
    import tritonclient.http as http

    from forge.server.triton_server import TritonServer

    with TritonServer(text_repo) as server:
        client = http.InferenceServerClient(server.http_url)
        for kind, prefix in (("byte_level", "bl_"), ("sentencepiece", "sp_")):
            tokenizer = _tokenizer(tokenizer_dirs[kind])
            queries = np.array([[b"hello world"], ["héllo wörld 🙂".encode()]], dtype=object)
            result = client.infer(f"{prefix}preprocessing", [
                _bytes_input(http, "QUERY", queries),
                _input(http, "REQUEST_OUTPUT_LEN", np.array([[16], [16]], dtype=np.int32), "INT32"),
                _bytes_input(http, "STOP_WORDS_DICT", np.array([[b"world"], [b"world"]], dtype=object))])
            expected = [tokenizer.encode(q[0].decode(), add_special_tokens=True) for q in queries]
            ids, lengths = result.as_numpy("INPUT_ID"), result.as_numpy("REQUEST_INPUT_LEN")
            assert lengths.reshape(-1).tolist() == [len(e) for e in expected]
            for row, want in zip(ids, expected):
                assert row[:len(want)].tolist() == want
            assert result.as_numpy("REQUEST_OUTPUT_LEN").reshape(-1).tolist() == [16, 16]
            assert result.as_numpy("OUT_END_ID").reshape(-1).tolist() == [tokenizer.eos_token_id] * 2
            stop = result.as_numpy("STOP_WORDS_IDS")
            world = tokenizer.encode("world", add_special_tokens=False)
            assert stop.shape[:2] == (2, 2) and stop[0, 0, :len(world)].tolist() == world
            if kind == "sentencepiece":  # its generation_config names a second end-of-turn id
                assert 5 in stop[0, 0].tolist()

            tokens = np.array([[tokenizer.encode("hello world", add_special_tokens=True)]], dtype=np.int32)
            result = client.infer(f"{prefix}postprocessing", [
                _input(http, "TOKENS_BATCH", tokens, "INT32"),
                _input(http, "SEQUENCE_LENGTH", np.array([[tokens.shape[2]]], dtype=np.int32), "INT32")])
            assert result.as_numpy("OUTPUT").reshape(-1)[0].decode() == "hello world"

            # Streaming: one token per call, each decoded in context; every piece is valid UTF-8 (the backend's
            # clients decode each), so a character split across tokens arrives as U+FFFD, the rest exactly.
            prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
            answer = tokenizer.encode(CONTINUATION, add_special_tokens=False)
            pieces = []
            for token in answer:
                result = client.infer(f"{prefix}postprocessing", [
                    _input(http, "TOKENS_BATCH", np.array([[[token]]], dtype=np.int32), "INT32"),
                    _input(http, "SEQUENCE_LENGTH", np.array([[1]], dtype=np.int32), "INT32")])
                pieces.append(result.as_numpy("OUTPUT").reshape(-1)[0])
            whole = tokenizer.decode(prompt + answer, skip_special_tokens=True)
            texts = [p.decode("utf-8") for p in pieces]
            assert ascii_of("".join(texts)) == ascii_of(whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):])

        # Bad input: an empty prompt is refused with a message, and the model keeps serving.
        with pytest.raises(Exception, match="empty"):
            client.infer("bl_preprocessing", [
                _bytes_input(http, "QUERY", np.array([[b""]], dtype=object)),
                _input(http, "REQUEST_OUTPUT_LEN", np.array([[4]], dtype=np.int32), "INT32")])
        assert client.is_model_ready("bl_preprocessing")


def _stream(client, grpc, model, inputs):
    """Send one request on a gRPC stream; return the byte pieces of ``text_output`` in order."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        pieces = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise AssertionError(str(error))
            response = result.get_response()
            if response.outputs:
                pieces.append(result.as_numpy("text_output").reshape(-1)[0])
            if response.parameters["triton_final_response"].bool_param:
                return pieces
    finally:
        client.stop_stream()


def _grpc_inputs(grpc, names: dict):
    inputs = []
    for name, (values, dtype) in names.items():
        tensor = grpc.InferInput(name, list(values.shape), dtype)
        tensor.set_data_from_numpy(values)
        inputs.append(tensor)
    return inputs


def test_ensemble_and_bls_stream_without_losing_text(tokenizer_dirs, tmp_path):
    """Decoupled ensemble and BLS over a generating test double: ensemble pieces are valid UTF-8 like the
    backend's (split characters become U+FFFD); BLS pieces join to the full text."""
    import tritonclient.grpc as grpc

    from forge.server.triton_server import TritonServer

    source = tokenizer_dirs["sentencepiece"]
    out = tmp_path / "repo"
    models, edges, ctx, comp = helpers.emit(source, out, tmp_path, options={"bls": True, "decoupled": True})
    models["tensorrt_llm"] = engine_double.generating_model(
        "tensorrt_llm", profiles.resolve(helpers.ENGINE), ctx.spec, source, CONTINUATION, decoupled=True)
    assert helpers.write(models, edges, out) == []

    tokenizer = _tokenizer(source)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
    answer = tokenizer.encode(CONTINUATION, add_special_tokens=False)
    full = tokenizer.decode(prompt + answer, skip_special_tokens=True)
    added = full[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
    assert added.startswith(" Paris")  # the space a token-by-token decode would lose

    def request(stream: bool):
        return _grpc_inputs(grpc, {
            "text_input": (np.array([[PROMPT.encode()]], dtype=object), "BYTES"),
            "max_tokens": (np.array([[len(answer)]], dtype=np.int32), "INT32"),
            "stop_words": (np.array([[b"zzz"]], dtype=object), "BYTES"),
            "stream": (np.array([[stream]]), "BOOL")})

    with TritonServer(out) as server:
        client = grpc.InferenceServerClient(server.grpc_url)
        pieces = _stream(client, grpc, "ensemble", request(True))
        assert len(pieces) == len(answer)
        streamed = "".join(p.decode("utf-8") for p in pieces)  # valid UTF-8 piece by piece, as the backend's
        assert ascii_of(streamed) == ascii_of(added) and streamed.startswith(" Paris")

        whole = _stream(client, grpc, "ensemble", request(False))
        assert [p.decode("utf-8") for p in whole] == [full]

        pieces = _stream(client, grpc, "tensorrt_llm_bls", request(True))
        texts = [p.decode("utf-8") for p in pieces]  # every BLS piece is valid UTF-8 on its own
        assert "".join(texts) == added and all("\ufffd" not in t for t in texts)

        whole = _stream(client, grpc, "tensorrt_llm_bls", request(False))
        assert [p.decode("utf-8") for p in whole] == [full]


def test_python_target_repository_generates_and_streams(tiny_gpt2, tmp_path):
    """forge build --target python --decoupled -o bls=true: real generation behind forge's text models."""
    import tritonclient.grpc as grpc

    from forge.cli import main
    from forge.server.triton_server import TritonServer

    out = tmp_path / "repo"
    assert main(["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out), "--target", "python",
                 "--dtype", "float32", "--max-input-len", "64", "--max-seq-len", "128", "--decoupled",
                 "-o", "bls=true"]) == 0

    def request(stream: bool):
        return _grpc_inputs(grpc, {
            "text_input": (np.array([[b"hello world"]], dtype=object), "BYTES"),
            "max_tokens": (np.array([[8]], dtype=np.int32), "INT32"),
            "stream": (np.array([[stream]]), "BOOL")})

    with TritonServer(out) as server:
        client = grpc.InferenceServerClient(server.grpc_url)
        for model in ("ensemble", "tensorrt_llm_bls"):
            whole = _stream(client, grpc, model, request(False))
            assert len(whole) == 1 and whole[0].startswith(b"hello world")
            pieces = _stream(client, grpc, model, request(True))
            assert 1 <= len(pieces) <= 8  # one piece per generated token (fewer if the end id comes)
            assert b"hello world" + b"".join(pieces) == whole[0]


def test_older_profiles_load_and_answer(tokenizer_dirs, tmp_path):
    """v0.5.0 (UINT32 ids, [-1] text) and v0.13.0 ensembles load on tritonserver and return the text."""
    import tritonclient.http as http

    from forge.server.triton_server import TritonServer

    source = tokenizer_dirs["byte_level"]
    out = tmp_path / "repo"
    for version, prefix in (("v0.5.0", "old_"), ("v0.13.0", "mid_")):
        models, edges, ctx, _ = helpers.emit(source, out, tmp_path / version, version=version, prefix=prefix)
        models[f"{prefix}tensorrt_llm"] = engine_double.generating_model(
            f"{prefix}tensorrt_llm", profiles.resolve(version), ctx.spec, source, CONTINUATION, decoupled=False)
        assert helpers.write(models, edges, out) == []
    tokenizer = _tokenizer(source)
    answer = tokenizer.encode(CONTINUATION, add_special_tokens=False)
    full = tokenizer.decode(tokenizer.encode(PROMPT, add_special_tokens=True) + answer, skip_special_tokens=True)
    with TritonServer(out) as server:
        client = http.InferenceServerClient(server.http_url)
        old = client.infer("old_ensemble", [
            _bytes_input(http, "text_input", np.array([[PROMPT.encode()]], dtype=object)),
            _input(http, "max_tokens", np.array([[len(answer)]], dtype=np.uint32), "UINT32"),
            _bytes_input(http, "bad_words", np.array([[b""]], dtype=object)),
            _bytes_input(http, "stop_words", np.array([[b""]], dtype=object))])
        assert old.as_numpy("text_output").reshape(-1)[0].decode() == full
        mid = client.infer("mid_ensemble", [
            _bytes_input(http, "text_input", np.array([[PROMPT.encode()]], dtype=object)),
            _input(http, "max_tokens", np.array([[len(answer)]], dtype=np.int32), "INT32")])
        assert mid.as_numpy("text_output").reshape(-1)[0].decode() == full
