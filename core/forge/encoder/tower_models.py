"""emit_config and ensemble edges of an encoder tower: preprocessing model → encoder model.

Text towers: ``<prefix>tokenizer`` (python; ``text_input`` STRING → ids) → ``<prefix>encoder``.
Image towers: ``<prefix>preprocessing`` (python; ``image`` bytes → ``pixel_values``) → ``<prefix>encoder``.
The encoder is a ``tensorrt_plan`` (tensorrt), an ``onnxruntime_onnx`` model (onnxruntime) or forge's
ONNX Runtime python model (python). Every ensemble answers ``embedding`` (FP32, one row per input).
Clients that already hold preprocessed float tensors call ``<prefix>encoder`` with ``pixel_values``.
"""

from __future__ import annotations

from .. import tritonconfig as tc
from ..components import Artifact, Component, Edge, TritonModel
from ..context import BuildContext
from .. import in_triton
from . import layout, input_models
from .adapter import EMBEDDING, IMAGE, TEXT, TowerInterface
from .encoder_options import EncoderOptions

TEXT_INPUT = "text_input"
IMAGE_INPUT = "image"
INSTANCE_KIND = {"auto": "KIND_AUTO", "cpu": "KIND_CPU", "gpu": "KIND_GPU"}


def preprocessing_name(component: Component, modality: str) -> str:
    return component.model_name("tokenizer" if modality == TEXT else "preprocessing")


def encoder_name(component: Component) -> str:
    return component.model_name("encoder")


def emit(component: Component, artifact: Artifact, ctx: BuildContext) -> list[TritonModel]:
    """The tower's preprocessing and encoder models."""
    iface = TowerInterface.from_json(artifact.meta["interface"])
    opts = EncoderOptions.read(ctx)
    return [_preprocessing(component, iface, artifact, opts, ctx), _encoder(component, iface, artifact, opts, ctx)]


def _batching(opts: EncoderOptions) -> dict | bool:
    return {"max_queue_delay_microseconds": opts.max_queue_delay_us} if opts.max_queue_delay_us else True


def _preprocessing(component: Component, iface: TowerInterface, artifact: Artifact, opts: EncoderOptions,
                   ctx: BuildContext) -> TritonModel:
    text = iface.modality == TEXT
    source = tc.model_input(TEXT_INPUT if text else IMAGE_INPUT, "STRING", [1])
    outputs = [tc.model_output(t.name, t.dtype, t.dims) for t in iface.inputs]
    config = tc.model_config(preprocessing_name(component, iface.modality), backend="python",
                             max_batch_size=ctx.spec.limits.max_batch_size, inputs=[source], outputs=outputs,
                             parameters=input_models.parameters(iface, opts),
                             instances=opts.preprocessing_instances, instance_kind="KIND_CPU",
                             dynamic_batching=True)
    files: dict = {"1/model.py": in_triton.TOKENIZER if text else in_triton.IMAGE, **in_triton.glue_files()}
    if text:
        files[f"1/{input_models.TOKENIZER_FILE}"] = artifact.path / layout.ASSETS / input_models.TOKENIZER_FILE
    return TritonModel(config, files)


def _encoder(component: Component, iface: TowerInterface, artifact: Artifact, opts: EncoderOptions,
             ctx: BuildContext) -> TritonModel:
    target = ctx.target
    # forge's python model pads requests of different lengths itself, so it can batch them all.
    ragged = target == "python"
    inputs = [tc.model_input(t.name, t.dtype, t.dims, allow_ragged_batch=ragged and -1 in t.dims)
              for t in iface.inputs]
    outputs = [tc.model_output(EMBEDDING, "FP32", iface.output.dims)]
    common = dict(max_batch_size=ctx.spec.limits.max_batch_size, inputs=inputs, outputs=outputs,
                  instances=opts.instances, dynamic_batching=_batching(opts))
    name = encoder_name(component)
    onnx_dir = artifact.path / layout.ONNX_DIR
    if target == "tensorrt":
        config = tc.model_config(name, platform="tensorrt_plan", instance_kind="KIND_GPU", **common)
        return TritonModel(config, {f"1/{layout.PLAN}": artifact.path / layout.PLAN})
    if target == "onnxruntime":
        config = tc.model_config(name, platform="onnxruntime_onnx", instance_kind=INSTANCE_KIND[opts.device],
                                 **common)
        return TritonModel(config, {"1": onnx_dir})
    config = tc.model_config(name, backend="python", instance_kind="KIND_CPU",
                             parameters={"model_file": layout.ONNX_FILE, "device": opts.device,
                                         "intra_op_threads": opts.intra_op_threads,
                                         "precision": artifact.meta.get("precision", "float32")}, **common)
    return TritonModel(config, {"1": onnx_dir, "1/model.py": in_triton.ONNX_ENCODER, **in_triton.glue_files()})


def edges(component: Component, models_by_name: dict[str, TritonModel]) -> list[Edge]:
    """ensemble input → preprocessing → encoder → ``embedding``."""
    enc = encoder_name(component)
    text = preprocessing_name(component, TEXT) in models_by_name
    pre = preprocessing_name(component, TEXT if text else IMAGE)
    if pre not in models_by_name or enc not in models_by_name:
        return []
    ensemble = component.ensemble
    source = TEXT_INPUT if text else IMAGE_INPUT
    result = [Edge.feed(source, pre, source, ensemble=ensemble)]
    result += [Edge.link(pre, t.name, enc, t.name, ensemble=ensemble) for t in models_by_name[enc].config.input]
    result.append(Edge.result(enc, EMBEDDING, EMBEDDING, ensemble=ensemble))
    return result
