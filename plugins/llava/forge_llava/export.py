"""The vision component's stages: the shared encoder export plus a check against transformers, and its model.

The shared export (:mod:`forge.encoder.onnx_export`) traces forge's vision module to ONNX and checks ONNX
Runtime against it. forge's module re-implements the feature selection (to drop the tower's unused
layers), so the export is also checked against transformers' own ``LlavaModel.get_image_features``
on the same parity images: both results go into the manifest.
"""

from __future__ import annotations

from forge.components import Artifact, Component, TritonModel
from forge.encoder import layout, encoder_parity as parity
from forge.encoder import onnx_export as encoder_export
from forge.encoder.input_models import image_parameters
from forge.encoder.adapter import TowerInterface
from forge.llm import multimodal

TOLERANCE = 1e-4  # max |Δ| / max(1, max |feature|), float32 ONNX Runtime vs torch


def export(adapter, component: Component, ctx) -> Artifact:
    """ONNX of the vision component, parity-checked against forge's module and transformers' get_image_features."""
    artifact = encoder_export.export(adapter, component, ctx)
    if ctx.dry_run:
        return artifact
    feeds, _ = parity.load(ctx.workdir / parity.SAMPLES_FILE)
    reference = transformers_features(component, feeds)
    stats = parity.measure(reference, parity.onnxruntime_outputs(layout.onnx_path(ctx.workdir), feeds))
    tolerance = ctx.option("parity_tolerance") or TOLERANCE
    ctx.note("parity_transformers", {**stats, "tolerance": tolerance, "against": "transformers "
                                     "LlavaModel.get_image_features (float32)", "runtime": "onnxruntime"})
    parity.check(stats, tolerance, f"{component.name}: vision export vs transformers get_image_features",
                 "raise it with -o vision_parity_tolerance if the difference is expected")
    return artifact


def transformers_features(component: Component, feeds) -> list:
    """transformers' ``get_image_features`` on the parity images (the language model stays on the meta device)."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from .checkpoint import read
    from .vision import load_parts

    facts = read(component.source)
    config = LlavaConfig.from_pretrained(str(facts.path))
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    tower, projector = load_parts(facts)
    model.model.vision_tower, model.model.multi_modal_projector = tower, projector
    results = []
    with torch.inference_mode():
        for f in feeds:
            pixels = torch.from_numpy(next(iter(f.values())))
            out = model.model.get_image_features(pixel_values=pixels, vision_feature_layer=facts.vision_feature_layer,
                                                 vision_feature_select_strategy=facts.strategy)
            features = out.pooler_output if hasattr(out, "pooler_output") else out
            results.append(torch.stack(list(features)).float().numpy())
    return results


def encoders_model(component: Component, artifact: Artifact, ctx) -> TritonModel:
    """``multimodal_encoders`` over the ONNX graph (python target) or the trtexec plan (tensorrtllm target)."""
    iface = TowerInterface.from_json(artifact.meta["interface"])
    if ctx.target == "tensorrtllm":
        files, model_file = {f"1/{layout.PLAN}": artifact.path / layout.PLAN}, layout.PLAN
    else:
        files, model_file = {f"1/{layout.ONNX_DIR}": artifact.path / layout.ONNX_DIR}, \
            f"{layout.ONNX_DIR}/{layout.ONNX_FILE}"
    return multimodal.encoders_model(component, artifact, ctx, files, image_parameters(iface), model_file)
