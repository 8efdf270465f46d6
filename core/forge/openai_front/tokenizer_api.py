"""vLLM's tokenizer endpoints: ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, with the served model's
own tokenizer (its preprocessing's), so counts are those that ``usage`` reports.

Tokenizer calls run on a worker thread, as the chat and completion routes' do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .catalog import TextModel
from .front import Front
from .protocol import APIError, DetokenizeRequest, TokenizeChat, TokenizePrompt, valid_text
from .schema import Detokenized, Tokenized, TokenizerInfo
from .translate import chat_prompt


def _model(front: Front, model_id: str | None) -> TextModel:
    """The text model whose tokenizer answers: the generator's, else an embedder's Hugging Face tokenizer."""
    if model_id is not None:
        front.resolve(model_id)
    catalog = front.catalog
    for model in (catalog.generator, catalog.embedder):
        if model is not None and model.tokenizer is not None and hasattr(model.tokenizer, "convert_ids_to_tokens"):
            return model
    raise APIError(400, f"model {catalog.model_id!r} has no tokenizer this server can use", param="model",
                   code="no_tokenizer")


async def tokenize(front: Front, body: TokenizePrompt | TokenizeChat) -> Tokenized:
    """The token ids of a text, or of chat messages templated as a chat request is."""
    model = _model(front, body.model)

    def run() -> Tokenized:
        from ..in_triton import forge_text

        if isinstance(body, TokenizeChat):
            front.generator()  # the chat template is the generator's
            text, _ = chat_prompt(front.catalog, body)
        else:
            text = valid_text(body.prompt, "prompt")
        special = model.add_special_tokens if body.add_special_tokens is None else body.add_special_tokens
        ids = forge_text.token_ids(text, model.tokenizer, special)
        answer = Tokenized(count=len(ids), max_model_len=front.catalog.max_model_len, tokens=ids)
        if body.return_token_strs:
            answer.token_strs = model.tokenizer.convert_ids_to_tokens(ids)
        return answer

    return await asyncio.to_thread(run)


async def detokenize(front: Front, body: DetokenizeRequest) -> Detokenized:
    """The text of token ids (special tokens kept, as vLLM decodes them)."""
    model = _model(front, body.model)
    vocab, longest = len(model.tokenizer), front.catalog.max_model_len
    if longest and len(body.tokens) > longest:
        raise APIError(400, f"tokens: {len(body.tokens)} ids, more than this model's {longest} (max_model_len)",
                       param="tokens", code="context_length_exceeded")
    wrong = next((t for t in body.tokens if t >= vocab), None)
    if wrong is not None:
        raise APIError(400, f"tokens: {wrong} is not a token id (the vocabulary has {vocab})", param="tokens")

    def run() -> Detokenized:
        from ..in_triton import forge_text

        return Detokenized(prompt=forge_text.decode(model.tokenizer, body.tokens, False))

    return await asyncio.to_thread(run)


def tokenizer_info(front: Front) -> TokenizerInfo:
    """The served tokenizer's configuration (file paths left out), class, length limit and chat template."""
    tokenizer = _model(front, None).tokenizer
    config = {key: _plain(value) for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if not key.endswith("_file") and key not in ("name_or_path", "tokenizer_object")}
    config["tokenizer_class"] = type(tokenizer).__name__
    # the length this server takes, where the tokenizer's own is HF's "unset" (1e30) or another model's
    own = getattr(tokenizer, "model_max_length", None)
    config["model_max_length"] = front.catalog.max_model_len or (int(own) if isinstance(own, (int, float)) else None)
    config["chat_template"] = getattr(tokenizer, "chat_template", None) or None
    return TokenizerInfo(**config)


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (an AddedToken as its text)."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
