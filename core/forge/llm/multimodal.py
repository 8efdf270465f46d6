"""A vision component that fills a decoder's prompt table: ``multimodal_encoders`` and its ensemble edges.

A composite family (llava) builds two components: the language model, answered by the decoder
plugin that owns its architecture, and a vision component exported by the shared encoder machinery.
The decoder component carries ``options["prompt_table"]`` (:func:`prompt_table_option`), which tells
this package's decoder code that another model fills its prompt table: preprocessing then expands the
image placeholder into the ids ``vocab_size … vocab_size+N−1`` (N = the table's rows; a request without
an image gets no table) and the ensemble links the encoder's outputs instead of feeding
``prompt_embedding_table`` from the client. The tensor names are tensorrtllm_backend's (``all_models/multimodal``, v0.13.0 on).

    image ─▶ multimodal_encoders ─▶ OUT_PROMPT_EMBEDDING_TABLE ─▶ tensorrt_llm.prompt_embedding_table
                                 ├▶ OUT_PROMPT_VOCAB_SIZE ──────▶ tensorrt_llm.prompt_vocab_size
                                 │                            └─▶ preprocessing.PROMPT_VOCAB_SIZE
                                 └▶ OUT_PROMPT_TABLE_EXTRA_ID ──▶ preprocessing.PROMPT_TABLE_EXTRA_ID
    text_input ─▶ preprocessing (placeholder → prompt-table ids) ─▶ tensorrt_llm ─▶ postprocessing

Every image's prompt-table ids are the same numbers (``vocab_size …``), so TensorRT-LLM's KV-cache reuse
(on by default from tensorrtllm_backend v0.14.0) would hand one image's cached blocks to another image's
request. The backend keys those blocks by ``prompt_table_extra_ids``; the encoder fills that id with a hash
of the image bytes (the same image shares its blocks, a different one never does), where the backend's own
ensemble leaves it to the client.
"""

from __future__ import annotations

from typing import Any, Mapping

from forge import in_triton
from forge import tritonconfig as tc
from forge.components import Artifact, Component, Edge, TritonModel
from forge.errors import UsageError

from .. import profiles
from .interface import LLM, PRE, profile_of, resolve_dtype, truthy

OPTION = "prompt_table"  # the decoder component's option naming the encoder that fills its table
ENCODERS = "multimodal_encoders"
IMAGE_INPUT = "image"  # the ensemble input: encoded image bytes
TEXT_INPUT, QUERY = "text_input", "QUERY"
IMAGE, TABLE, ROWS = "IMAGE", "OUT_PROMPT_EMBEDDING_TABLE", "OUT_PROMPT_VOCAB_SIZE"
EXTRA_ID = "OUT_PROMPT_TABLE_EXTRA_ID"  # a hash of the image: keys its KV-cache blocks
PRE_ROWS, PRE_EXTRA_ID = "PROMPT_VOCAB_SIZE", "PROMPT_TABLE_EXTRA_ID"  # preprocessing inputs the encoder feeds
FED = ((LLM, "prompt_embedding_table"), (LLM, "prompt_vocab_size"), (PRE, PRE_EXTRA_ID))  # no longer the client's
FIRST_VERSION = "v0.13.0"  # the first release whose ensemble feeds the table to tensorrt_llm directly
#: how the vision graph runs inside multimodal_encoders, per target of the vision component
RUNTIMES = {"python": "onnxruntime", "tensorrtllm": "tensorrt"}


def prompt_table_option(encoder: str, image_token_id: int, rows: int, placeholder: str) -> dict[str, Any]:
    """``Component.options`` of a decoder whose prompt table ``encoder`` fills (json-able: it is fingerprinted)."""
    return {OPTION: {"encoder": encoder, "image_token_id": image_token_id, "rows": rows,
                     "placeholder": placeholder}}


def prompt_table(component: Component) -> Mapping[str, Any] | None:
    """The decoder component's prompt-table settings (None: a text-only decoder)."""
    return component.options.get(OPTION)


def check_spec(spec) -> None:
    """Refuse builds whose backend release has no direct prompt-table route, or whose BLS cannot take images."""
    profile = profile_of(spec)
    versions = list(profiles.PROFILES)
    if versions.index(profile.version) < versions.index(FIRST_VERSION):
        raise UsageError(f"multimodal repositories follow tensorrtllm_backend {FIRST_VERSION} or newer; "
                         f"--backend-version {profile.version} routes the prompt table another way",
                         hint=f"build with --backend-version {FIRST_VERSION} or newer")
    if truthy(spec.options.get("bls", False)):
        raise UsageError("-o bls=true: forge's tensorrt_llm_bls does not route images; the multimodal "
                         "repository is served by its ensemble", hint="drop -o bls")


def table_dtype(spec) -> str:
    """The Triton dtype of tensorrt_llm's prompt_embedding_table for this build (the encoder emits the same)."""
    tensor = profile_of(spec).interface(LLM).input("prompt_embedding_table")
    return resolve_dtype(tensor.dtype, spec)


def encoders_model(component: Component, artifact: Artifact, ctx, files: Mapping[str, Any],
                   preprocessing: Mapping[str, str], model_file: str) -> TritonModel:
    """The ``multimodal_encoders`` python model over the vision graph in ``files``."""
    spec = ctx.spec
    rows, hidden = artifact.meta["interface"]["output"]["dims"]
    runtime = RUNTIMES[ctx.target]
    parameters = {**preprocessing, "runtime": runtime, "model_file": model_file, "visual_tokens": rows,
                  "hidden_size": hidden, "intra_op_threads": ctx.option("vision_threads", 0)}
    config = tc.model_config(
        component.model_name(ENCODERS), backend="python", max_batch_size=spec.limits.max_batch_size,
        # Triton runs an ensemble step only when it receives an input: the prompt rides along, so text-only
        # requests (no image) pass through it too and get an empty table.
        inputs=[tc.model_input(IMAGE, "STRING", [1], optional=True), tc.model_input(QUERY, "STRING", [1])],
        outputs=[tc.model_output(TABLE, table_dtype(spec), [-1, hidden]), tc.model_output(ROWS, "INT32", [1]),
                 tc.model_output(EXTRA_ID, "UINT64", [1])],
        parameters=parameters, instances=1,
        instance_kind="KIND_GPU" if runtime == "tensorrt" else "KIND_CPU", dynamic_batching=True)
    shipped = {"1/model.py": in_triton.MULTIMODAL_ENCODERS.read_bytes(), **in_triton.glue_files(),
               "1/forge_image.py": in_triton.IMAGE.read_bytes(), "1/forge_onnx.py": in_triton.ONNX_ENCODER.read_bytes()}
    return TritonModel(config, {**files, **shipped})


def preprocessing_io(component: Component) -> tuple[list, dict[str, Any]]:
    """Preprocessing's extra input and parameters when an encoder fills the decoder's prompt table."""
    table = prompt_table(component)
    if table is None:
        return [], {}
    return ([tc.model_input(PRE_ROWS, "INT32", [1], optional=True)],
            {"image_token_id": table["image_token_id"], "image_placeholder": table["placeholder"]})


def edges(decoder: Component) -> list[Edge]:
    """``image`` → multimodal_encoders → tensorrt_llm's prompt table and preprocessing's row count."""
    table = prompt_table(decoder)
    if table is None:
        return []
    encoder, ensemble = table["encoder"], decoder.ensemble
    pre, llm = decoder.model_name(PRE), decoder.model_name(LLM)
    return [Edge.feed(IMAGE_INPUT, encoder, IMAGE, ensemble=ensemble),
            Edge.feed(TEXT_INPUT, encoder, QUERY, ensemble=ensemble),
            Edge.link(encoder, TABLE, llm, "prompt_embedding_table", ensemble=ensemble),
            Edge.link(encoder, ROWS, llm, "prompt_vocab_size", ensemble=ensemble),
            Edge.link(encoder, ROWS, pre, PRE_ROWS, ensemble=ensemble),
            Edge.link(encoder, EXTRA_ID, pre, PRE_EXTRA_ID, ensemble=ensemble)]
