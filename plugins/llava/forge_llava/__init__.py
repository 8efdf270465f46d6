"""forge's llava family: LLaVA-1.5 checkpoints → a multimodal Triton repository, composed of other families' parts.

The family builds two components from one ``LlavaForConditionalGeneration`` checkpoint:

* the **language model**, a ``llama`` component: its part of the checkpoint is written as a plain
  Llama checkpoint (:mod:`forge.subcheckpoint`) and the llama plugin answers every stage of it
  (export, quantize, compile, preprocessing / tensorrt_llm / postprocessing, ensemble) — this package
  imports nothing of forge_llama; the component's ``prompt_table`` option tells the shared decoder
  code that an encoder fills its prompt table;
* the **vision component** (CLIP tower + feature selection + projector), answered here with the shared
  encoder machinery: ONNX export parity-checked against torch and against transformers'
  ``get_image_features``, a ``trtexec`` plan on ``--target tensorrtllm``, served by
  ``multimodal_encoders`` (:mod:`forge.llm.multimodal`).

The ensemble takes ``text_input`` (with the image placeholder, e.g. ``<image>``) and ``image``
(encoded bytes); without an image it is the plain text pipeline of the same repository.
"""

from __future__ import annotations

import dataclasses
import json

from forge import hookimpl
from forge.components import Component, DeferredOptions, Family, Option
from forge.errors import UsageError

from .checkpoint import ARCHITECTURES, TOKENIZER_FILES

FAMILY = "llava"
LANGUAGE_FAMILY = "llama"  # the family whose plugin answers the language-model component
TARGETS = ("python", "tensorrtllm")  # python: everything runs here (CPU or GPU); tensorrtllm: engines, on a GPU
VISION = "vision"

#: options of the vision component (named apart from the decoder options they would collide with)
VISION_OPTIONS = (
    Option("vision_opset", "int", "ONNX opset of the vision export (13 to 21)", 17, minimum=13),
    Option("vision_parity_tolerance", "float", "max |Δ| of the vision export against torch / transformers "
           "(default 1e-4 relative)", None, exclusive_minimum=0),
    Option("vision_threads", "int", "ONNX Runtime threads of multimodal_encoders (0: all cores)", 0, ("python",),
           minimum=0),
    Option("vision_workspace_mib", "int", "trtexec workspace pool of the vision plan in MiB", 4096,
           ("tensorrtllm",), minimum=1),
)
_VISION_KEYS = {"vision_opset": "opset", "vision_parity_tolerance": "parity_tolerance",
                "vision_workspace_mib": "workspace_mib"}


def _options():
    from forge.llm.decoder_options import decoder_options

    return decoder_options() + VISION_OPTIONS


def _adapter():
    from forge.encoder.adapter import IMAGE, EncoderAdapter, Tower

    def open_source(path, ctx):
        from .checkpoint import read
        from .vision import LlavaVisionSource

        return LlavaVisionSource(read(path, allow_pickle=ctx.spec.allow_pickle,
                                      trust_remote_code=ctx.spec.trust_remote_code))

    return EncoderAdapter(family=FAMILY, description="LLaVA vision tower + projector",
                          architectures=ARCHITECTURES, towers=(Tower(VISION, IMAGE, "ensemble"),),
                          open_source=open_source)


def _vision_ctx(ctx):
    """The stage context the encoder machinery reads: the vision options under its own names."""
    options = {_VISION_KEYS[k]: v for k, v in ctx.spec.options.items() if k in _VISION_KEYS}
    spec = dataclasses.replace(ctx.spec, options=options)
    return dataclasses.replace(ctx, spec=spec, target="tensorrt" if ctx.target == "tensorrtllm" else "python")


def _placeholder(path, token_id: int) -> str:
    """The text of the image token (``<image>``), as the tokenizer writes it."""
    file = path / "tokenizer.json"
    if file.is_file():
        for token in json.loads(file.read_text()).get("added_tokens", []):
            if token.get("id") == token_id:
                return str(token.get("content"))
    return "<image>"


class LlavaPlugin:
    """The llava family: declares its components, answers the vision component's stages."""

    def _mine(self, component: Component) -> bool:
        return component.family == FAMILY

    def components(self, spec) -> list[Component]:
        from forge import subcheckpoint
        from forge.llm import multimodal
        from forge.llm.decoder_options import check_options, has_trtllm_build, no_trtllm_build

        from .checkpoint import read

        target = spec.target or TARGETS[0]
        profile = check_options(spec)
        if profile.llmapi:  # only named explicitly: without --backend-version the driver picks an engine release
            raise UsageError(f"llava on TensorRT-LLM {profile.version} (one LLM-API tensorrt_llm model taking image_url) "
                             "is not built by forge yet",
                             hint="build --backend-version 1.2.1: the vision encoder fills the decoder's prompt table")
        multimodal.check_spec(spec)
        if target == "python":
            from forge.llm.pytarget import check_spec

            check_spec(spec)
        elif not spec.dry_run and not has_trtllm_build(profile.version):
            raise UsageError(no_trtllm_build(profile.version))
        source = spec.source_for(FAMILY)
        facts = read(source, allow_pickle=spec.allow_pickle, trust_remote_code=spec.trust_remote_code)
        if spec.limits.max_input_len <= facts.visual_tokens:
            raise UsageError(f"--max-input-len {spec.limits.max_input_len} leaves no room for the prompt: one image "
                             f"alone takes {facts.visual_tokens} tokens",
                             hint="raise --max-input-len (and --max-seq-len)")
        language_model = subcheckpoint.extract(source, facts.text_config, facts.language_model_name,
                                               what="llava-language-model", extra_files=TOKENIZER_FILES)
        prefix = spec.name_prefix
        table = multimodal.prompt_table_option(f"{prefix}{multimodal.ENCODERS}", facts.image_token_id,
                                               facts.visual_tokens, _placeholder(source, facts.image_token_id))
        return [
            Component(name=f"{prefix}{FAMILY}_{VISION}", family=FAMILY, role=VISION, source=source, prefix=prefix,
                      ensemble=f"{prefix}ensemble"),
            Component(name=f"{prefix}{FAMILY}_language_model", family=LANGUAGE_FAMILY, role="llm",
                      source=language_model, prefix=prefix, ensemble=f"{prefix}ensemble", options=table),
        ]

    @hookimpl
    def forge_register_families(self, register):
        from forge.llm.plugin import QUANTS

        register(Family(name=FAMILY, kind="decoder", architectures=ARCHITECTURES, targets=TARGETS,
                        description="LLaVA-1.5 (CLIP vision tower + projector + Llama) as a multimodal ensemble",
                        default_target=TARGETS[0], components=self.components, layouts=("engine",),
                        quants=tuple(q for q in QUANTS), parallel_targets=("tensorrtllm",),
                        options=DeferredOptions(_options)))

    @hookimpl
    def forge_export(self, component, ctx):
        if not self._mine(component):
            return None
        from . import export

        return export.export(_adapter(), component, _vision_ctx(ctx))

    @hookimpl
    def forge_quantize(self, component, artifact, ctx):
        return None  # the vision component stays float (--quant applies to the language model)

    @hookimpl
    def forge_compile(self, component, artifact, ctx):
        if not self._mine(component) or ctx.target != "tensorrtllm":
            return None  # the python target runs the ONNX graph with ONNX Runtime
        from forge.encoder import tensorrt

        return tensorrt.compile(component, artifact, _vision_ctx(ctx))

    @hookimpl
    def forge_emit_config(self, component, artifact, ctx):
        if not self._mine(component):
            return None
        from . import export

        return [export.encoders_model(component, artifact, ctx)]

    @hookimpl
    def forge_ensemble_edges(self, components, models, ctx):
        from forge.llm import multimodal

        mine = {c.prefix for c in components if self._mine(c)}
        return [edge for c in components if c.family != FAMILY and c.prefix in mine
                for edge in multimodal.edges(c)]


#: The object the ``forge.plugins`` entry point ``llava = forge_llava:plugin`` loads.
plugin = LlavaPlugin()

__all__ = ["plugin"]
