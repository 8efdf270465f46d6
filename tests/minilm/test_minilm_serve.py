"""all-MiniLM-L6-v2 built for --target python and served by the real tritonserver."""

from __future__ import annotations

import numpy as np
import pytest
from encoder_fixtures import built, cosine, infer, manifest_notes, serving

from forge.tritonconfig import read

pytestmark = pytest.mark.heavy

TEXTS = ["A man is eating food.", "", "word " * 400, "Triton serves sentence embeddings.",
         "  spaces around  ", "Ünïcödé text — with punctuation!?"]


@pytest.fixture(scope="module")
def reference(minilm_model):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_model), device="cpu")
    return lambda texts: model.encode(list(texts), normalize_embeddings=True)


@pytest.fixture(scope="module")
def minilm_server(encoder_environment, minilm_model, tmp_path_factory):
    """The default python-target repository (float32 on a machine whose ONNX Runtime has no GPU), served once
    for the module."""
    repo = built(tmp_path_factory.mktemp("minilm") / "repo", "--family", "minilm", "--model", str(minilm_model),
                 "--target", "python")
    with serving(repo) as (server, client):
        yield repo, server, client


def test_build_records_export_parity_and_the_default_dtype(minilm_server):
    """Without --dtype, the python target on a CPU keeps float32 (float16 is slower on ONNX Runtime's CPU
    provider) and says so; the manifest records the export's parity."""
    import onnxruntime

    repo, _, _ = minilm_server
    export = manifest_notes(repo, "minilm", "export")
    assert export["parity"]["max_abs_diff"] < 1e-4 and export["parity"]["precision"] == "float32"
    assert export["tokenizer_parity"]["identical"]
    assert export["export"]["opset"] == 17 and "constant folding" in export["export"]["changes"][0]
    assert export["interface"]["pooling"] == ["mean"] and export["interface"]["normalize"] is True
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime serves on a GPU: the default stays float16")
    assert "float32 kept" in manifest_notes(repo, "minilm", "quantize")["dtype"]
    assert read(repo / "minilm_encoder").parameters["precision"].string_value == "float32"


def test_float16_when_asked(minilm_model, tmp_path):
    """--dtype float16 on a CPU: the graph is converted, with its parity against torch recorded."""
    repo = built(tmp_path / "repo", "--family", "minilm", "--model", str(minilm_model), "--target", "python",
                 "--dtype", "float16")
    fp16 = manifest_notes(repo, "minilm", "quantize")
    assert "dtype" not in fp16
    assert fp16["parity"]["precision"] == "float16" and fp16["parity"]["min_cosine"] > 0.9999
    assert read(repo / "minilm_encoder").parameters["precision"].string_value == "float16"


def test_embeddings_equal_sentence_transformers(minilm_server, reference):
    """Short, empty and over-long (truncated at 256 tokens) texts, in one request and one by one."""
    _, _, client = minilm_server
    expected = reference(TEXTS)
    together = infer(client, "ensemble", "text_input", TEXTS)
    assert together.shape == (len(TEXTS), 384) and together.dtype == np.float32
    assert cosine(together, expected).min() >= 0.999
    for text, row in zip(TEXTS, expected):
        alone = infer(client, "ensemble", "text_input", [text])
        assert cosine(alone, row[None]).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-3)


def test_concurrent_requests_of_different_lengths(minilm_server, reference):
    """Requests batched together by Triton (different lengths: ragged) each get their own embedding."""
    import tritonclient.http as http

    _, _, client = minilm_server
    texts = [("word " * (i * 7)).strip() or "x" for i in range(16)]
    pending = []
    for text in texts:
        tensor = http.InferInput("text_input", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
        pending.append(client.async_infer("ensemble", [tensor]))
    served = np.concatenate([p.get_result().as_numpy("embedding") for p in pending])
    assert cosine(served, reference(texts)).min() >= 0.999


def test_encoder_answers_token_ids_directly(minilm_server):
    """Clients with their own tokenizer call minilm_encoder with ids and mask (INT32)."""
    import tritonclient.http as http

    _, _, client = minilm_server
    ids = np.array([[101, 7592, 2088, 102, 0], [101, 2088, 102, 0, 0]], dtype=np.int32)
    mask = (ids != 0).astype(np.int32)
    inputs = []
    for name, value in (("input_ids", ids), ("attention_mask", mask)):
        tensor = http.InferInput(name, list(value.shape), "INT32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    direct = client.infer("minilm_encoder", inputs).as_numpy("embedding")
    via_ensemble = infer(client, "ensemble", "text_input", ["hello world", "world"])
    assert cosine(direct, via_ensemble).min() >= 0.9999


def test_bad_inputs_get_errors_and_the_server_keeps_serving(minilm_server, reference):
    """Invalid UTF-8, an empty batch, a wrong dtype and a wrong shape are refused with errors."""
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    _, server, client = minilm_server
    with pytest.raises(InferenceServerException, match="not valid UTF-8"):
        infer(client, "ensemble", "text_input", [b"\xff\xfe bad"])
    empty = http.InferInput("text_input", [0, 1], "BYTES")
    empty.set_data_from_numpy(np.zeros((0, 1), dtype=object))
    with pytest.raises(InferenceServerException):
        client.infer("ensemble", [empty])
    wrong_dtype = http.InferInput("text_input", [1, 1], "INT32")
    wrong_dtype.set_data_from_numpy(np.zeros((1, 1), dtype=np.int32))
    with pytest.raises(InferenceServerException, match="data-type"):
        client.infer("ensemble", [wrong_dtype])
    wrong_shape = http.InferInput("text_input", [1, 2], "BYTES")
    wrong_shape.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=object))
    with pytest.raises(InferenceServerException):
        client.infer("ensemble", [wrong_shape])
    out_of_vocab = http.InferInput("input_ids", [1, 2], "INT32")
    out_of_vocab.set_data_from_numpy(np.array([[101, 10 ** 6]], dtype=np.int32))
    mask = http.InferInput("attention_mask", [1, 2], "INT32")
    mask.set_data_from_numpy(np.ones((1, 2), dtype=np.int32))
    with pytest.raises(InferenceServerException):
        client.infer("minilm_encoder", [out_of_vocab, mask])
    assert client.is_server_live() and client.is_model_ready("ensemble")
    assert cosine(infer(client, "ensemble", "text_input", ["still here"]), reference(["still here"]))[0] >= 0.999


def test_openai_embeddings_equal_sentence_transformers(minilm_server, reference):
    """POST /v1/embeddings through the real openai client: float and base64, one text and a list; dimensions
    other than the model's refused with 400; token-id input refused."""
    openai = pytest.importorskip("openai")
    from forge.openai_front import OpenAIServer

    repo, server, _ = minilm_server
    front = OpenAIServer(repo, server.grpc_url, port=0).start()
    try:
        api = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0)
        assert [m.id for m in api.models.list().data] == [repo.name]
        texts = [t for t in TEXTS if t]
        answer = api.embeddings.create(model=repo.name, input=texts, encoding_format="float")
        vectors = np.array([d.embedding for d in answer.data], dtype=np.float32)
        assert [d.index for d in answer.data] == list(range(len(texts))) and vectors.shape == (len(texts), 384)
        assert cosine(vectors, reference(texts)).min() >= 0.999
        assert answer.usage.prompt_tokens > len(texts) and answer.usage.total_tokens == answer.usage.prompt_tokens
        # the openai client asks for base64 by default and decodes it itself
        (one,) = api.embeddings.create(model=repo.name, input=texts[0]).data
        assert cosine(np.array([one.embedding]), reference(texts[:1])).min() >= 0.999
        raw = api.embeddings.with_raw_response.create(model=repo.name, input="x", encoding_format="base64").parse()
        assert isinstance(raw.data[0].embedding, (str, list))
        with pytest.raises(openai.BadRequestError, match="384-dimensional"):
            api.embeddings.create(model=repo.name, input="x", dimensions=128)
        with pytest.raises(openai.BadRequestError, match="token ids"):
            api.embeddings.create(model=repo.name, input=[[1, 2, 3]])
        with pytest.raises(openai.BadRequestError, match="embedding model"):
            api.chat.completions.create(model=repo.name, messages=[{"role": "user", "content": "hi"}])
    finally:
        front.stop()
