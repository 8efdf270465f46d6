"""``/v1/embeddings``: each text through the served embedder, the vectors as floats or base64."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from .front import Front
from .protocol import APIError, EmbeddingRequest, valid_text
from .schema import Embedding, EmbeddingList, EmbeddingUsage


async def answer(front: Front, body: EmbeddingRequest) -> EmbeddingList:
    """The ``list`` of embeddings, one a text, with the tokens counted on a worker thread."""
    catalog = front.catalog
    front.resolve(body.model)
    model = catalog.embedder
    if model is None:
        raise APIError(400, f"model {catalog.model_id!r} makes no embeddings (it generates text); use "
                            "/v1/chat/completions", param="model", code="wrong_endpoint")
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts:
        raise APIError(400, "input must not be an empty list", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "input as token ids is not supported: send text", param="input",
                       code="unsupported_parameter")
    for text in texts:
        valid_text(text, "input")
    if body.dimensions is not None and body.dimensions != catalog.embedding_dim:
        raise APIError(400, f"dimensions: this model makes {catalog.embedding_dim}-dimensional embeddings and "
                            "cannot shorten them", param="dimensions", code="unsupported_parameter")

    async def one(text: str) -> np.ndarray:
        tensors = {"text_input": model.inputs.array("text_input", text)}
        outputs = await front.triton.infer(model.inputs, tensors, "", ["embedding"])
        return np.asarray(outputs["embedding"], dtype=np.float32).reshape(-1)

    vectors = await asyncio.gather(*(one(t) for t in texts))
    data = []
    for index, vector in enumerate(vectors):
        value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode() \
            if body.encoding_format == "base64" else vector.tolist()
        data.append(Embedding(index=index, embedding=value))
    tokens = None
    if model.tokenizer is not None:
        tokens = await asyncio.to_thread(lambda: sum(model.count(t) for t in texts))
    return EmbeddingList(data=data, model=body.model,
                         usage=None if tokens is None else EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
