"""The interface of Triton's vLLM backend, seen by the front as the LLM-API model's ``sampling_param_*`` inputs.

A vLLM-backend model takes every sampling setting in one JSON input, ``sampling_parameters`` (vLLM's
``SamplingParams`` fields). The catalog gives such a model one virtual input per field the front sends,
named as the LLM-API interface names them (``sampling_param_max_tokens``, ``sampling_param_stop`` …), so the
requests are translated once for every target; :func:`fold` turns them back into the JSON before sending, and
:func:`with_adapter` adds the LoRA adapter a model id names. The LLM-API layout's guided decoding inputs become
vLLM's ``structured_outputs`` (a JSON text, as the backend parses it), and ``logprobs`` asks the backend's
``return_logprobs`` output, which carries vLLM's log-probs of each generated token.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from ..clients.inference import GUIDE, GUIDE_TYPE, SAMPLING_JSON, ModelInputs
from .protocol import APIError

SAMPLING = SAMPLING_JSON
PREFIX = "sampling_param_"
#: the SamplingParams fields the front sends, as (Triton dtype, dims) of their virtual input
FIELDS = {"max_tokens": ("INT32", [1]), "temperature": ("FP32", [1]), "top_k": ("INT32", [1]), "top_p": ("FP32", [1]),
          "seed": ("UINT64", [1]), "presence_penalty": ("FP32", [1]), "frequency_penalty": ("FP32", [1]),
          "repetition_penalty": ("FP32", [1]), "min_p": ("FP32", [1]), "min_tokens": ("INT32", [1]),
          "ignore_eos": ("BOOL", [1]), "stop": ("STRING", [-1]), "stop_token_ids": ("INT32", [-1]),
          "include_stop_str_in_output": ("BOOL", [1]), "skip_special_tokens": ("BOOL", [1]),
          "spaces_between_special_tokens": ("BOOL", [1]), "logprobs": ("INT32", [1])}
#: the guided decoding inputs of the LLM-API layout, sent as ``structured_outputs``
GUIDES = {GUIDE_TYPE: ("STRING", [1]), GUIDE: ("STRING", [1])}
#: a guide type of the LLM-API layout → the field of vLLM's ``StructuredOutputsParams`` that takes it
STRUCTURED = {"json": "json", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar",
              "structural_tag": "structural_tag"}


def is_vllm(inputs: ModelInputs) -> bool:
    """Whether the model takes the vLLM backend's interface (text and one JSON of sampling parameters)."""
    return "text_input" in inputs.inputs and SAMPLING in inputs.inputs


def with_virtual_inputs(inputs: ModelInputs) -> ModelInputs:
    """``inputs`` with a virtual ``sampling_param_<field>`` input per field (vLLM-backend models only)."""
    if not is_vllm(inputs):
        return inputs
    virtual = {f"{PREFIX}{name}": typed for name, typed in FIELDS.items() if f"{PREFIX}{name}" not in inputs.inputs}
    virtual.update({name: typed for name, typed in GUIDES.items() if name not in inputs.inputs})
    return replace(inputs, inputs={**inputs.inputs, **virtual})


def fold(inputs: ModelInputs, payload: dict[str, Any], *, stream: bool) -> dict[str, Any]:
    """The virtual inputs of ``payload`` as the one JSON ``sampling_parameters`` (vLLM-backend models only).

    Greedy requests (``top_k`` 1, TensorRT-LLM's greedy) go as vLLM's greedy, ``temperature`` 0: with a LoRA
    adapter vLLM's CPU sampler does not always pick the same token for the two. Streamed, the vLLM backend
    counts ``num_output_tokens`` per response, not in total: the front counts the answer's tokens itself then."""
    if not is_vllm(inputs):
        return payload
    values = {name[len(PREFIX):]: _plain(value) for name, value in payload.items()
              if name.startswith(PREFIX) and name[len(PREFIX):] in FIELDS}
    kept = {name: value for name, value in payload.items() if not (name.startswith(PREFIX)
                                                                   and name[len(PREFIX):] in FIELDS)}
    kind, guide = _plain(kept.pop(GUIDE_TYPE, None)), _plain(kept.pop(GUIDE, None))
    if kind is not None:
        if kind not in STRUCTURED:
            raise APIError(400, f"guided decoding of type {kind!r} is not one Triton's vLLM backend takes "
                                f"({', '.join(STRUCTURED)})", param="response_format", code="invalid_value")
        values["structured_outputs"] = json.dumps({STRUCTURED[kind]: guide})
    if values.get("logprobs") is not None and "return_logprobs" in inputs.inputs:
        kept["return_logprobs"] = True
    if values.get("top_k") == 1 and "temperature" not in values:  # greedy: vLLM's own greedy (temperature 0)
        values = {**{k: v for k, v in values.items() if k != "top_k"}, "temperature": 0}
    if stream:
        kept.pop("return_num_output_tokens", None)
    kept[SAMPLING] = json.dumps(values)
    return kept


def with_adapter(inputs: ModelInputs, tensors: dict[str, Any], adapter: Any) -> dict[str, Any]:
    """A request's tensors asking for a LoRA adapter: a vLLM-backend model takes its name in
    ``sampling_parameters`` (``lora_name``, a key of the model's ``multi_lora.json``)."""
    if adapter is None or not is_vllm(inputs):
        return tensors
    raw = tensors[SAMPLING].reshape(-1)[0]
    values = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return {**tensors, SAMPLING: inputs.array(SAMPLING, json.dumps({**values, "lora_name": adapter.name}))}


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.item() if hasattr(value, "item") else value
