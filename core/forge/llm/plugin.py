"""The hook implementations every decoder family shares; a family plugin is one adapter.

Heavy modules (torch, transformers) are imported inside the hooks so ``forge plugins`` stays fast.
"""

from __future__ import annotations

from forge import hookimpl
from forge.components import Component, DeferredOptions, Family
from forge.errors import UsageError

from .adapter import DecoderAdapter

TARGETS = ("tensorrtllm", "python", "hf-pipeline", "vllm")
QUANTS = ("w8a16", "w4a16", "int4_awq", "fp8", "int8_kv")


def family_options():
    """Every option of a decoder family: the decoder options, --lora, the vllm target's engine arguments."""
    from dataclasses import replace

    from .decoder_options import LORA, decoder_options
    from .vllm_target import OPTIONS, SHARED, TARGET

    def shared(o):
        vllm = "" if o.name == "lora" else f"; --target vllm: vLLM's {o.name} in model.json"
        return replace(o, targets=o.targets + (TARGET,), help=o.help + vllm)

    options = [shared(o) if o.name in SHARED else o for o in decoder_options() + (LORA,)]
    return tuple(options) + OPTIONS


class DecoderPlugin:
    """Implements forge's hooks for one decoder family described by ``adapter``."""

    def __init__(self, adapter: DecoderAdapter):
        self.adapter = adapter

    def _mine(self, component: Component) -> bool:
        return component.family == self.adapter.family

    def _components(self, spec) -> list[Component]:
        from .decoder_options import check_options, has_trtllm_build, no_trtllm_build

        if spec.target == "vllm":  # Triton's vLLM backend: its own releases, none of TensorRT-LLM's parameters
            return self._vllm_components(spec)
        profile = check_options(spec)  # bad -o values / --backend-version fail before any stage runs
        target = spec.target or "tensorrtllm"
        if profile.llmapi:
            from .llmapi import check_spec as check_llmapi

            check_llmapi(spec, profile, target, self.adapter)
        elif target == "tensorrtllm" and not spec.dry_run and not has_trtllm_build(profile.version):
            raise UsageError(no_trtllm_build(profile.version),
                             hint="build for --backend-version 0.8.0 or newer, or --target python (it serves this "
                                  "release's interface)")
        if spec.target == "python":
            from .pytarget import check_spec

            check_spec(spec)
        elif spec.target == "hf-pipeline":
            from .hfpipeline import check_spec

            check_spec(spec)
        family = self.adapter.family
        options = {}
        if "lora" in spec.options:  # bad adapters fail here, before any stage runs
            from .lora_format import check_build, for_build, summary

            adapters = for_build(self.adapter, spec, spec.source_for(family))
            check_build(spec, profile, adapters)
            options["lora"] = summary(adapters)
        return [Component(name=f"{spec.name_prefix}{family}", family=family, role="llm",
                          source=spec.source_for(family), prefix=spec.name_prefix,
                          ensemble=f"{spec.name_prefix}ensemble", options=options)]

    def _vllm_components(self, spec) -> list[Component]:
        from .vllm_target import check_spec

        check_spec(spec)
        family, options = self.adapter.family, {}
        if spec.options.get("lora"):
            from .lora_format import for_build, summary

            options["lora"] = summary(for_build(self.adapter, spec, spec.source_for(family)))
        return [Component(name=f"{spec.name_prefix}{family}", family=family, role="llm",
                          source=spec.source_for(family), prefix=spec.name_prefix,
                          ensemble=f"{spec.name_prefix}ensemble", options=options)]

    @hookimpl
    def forge_register_families(self, register):
        a = self.adapter
        register(Family(name=a.family, kind="decoder", description=a.description,
                        architectures=a.architectures, targets=TARGETS, default_target="tensorrtllm",
                        components=self._components, quants=QUANTS, parallel_targets=("tensorrtllm", "python", "vllm"),
                        options=DeferredOptions(family_options)))

    @hookimpl
    def forge_export(self, component, ctx):
        if not self._mine(component):
            return None
        if ctx.target == "hf-pipeline":
            from . import hfpipeline

            return hfpipeline.export(component.source, ctx)
        if ctx.target == "vllm":
            from . import vllm_target

            return vllm_target.export(component.source, ctx)
        if ctx.target == "tensorrtllm" and _llmapi(ctx):  # the LLM API loads the checkpoint as it is
            from . import llmapi

            return llmapi.export(self.adapter, component.source, ctx)
        from . import checkpoint

        return checkpoint.export(self.adapter, component.source, ctx)

    @hookimpl
    def forge_quantize(self, component, artifact, ctx):
        if not self._mine(component) or not ctx.spec.quant:
            return None
        if _llmapi(ctx):
            from . import llmapi

            return llmapi.quantize(self.adapter, component.source, artifact, ctx)
        from . import weight_quant

        return weight_quant.quantize(self.adapter, component.source, artifact, ctx)

    @hookimpl
    def forge_compile(self, component, artifact, ctx):
        if not self._mine(component) or ctx.target != "tensorrtllm" or _llmapi(ctx):
            return None  # the python target and the LLM API serve the checkpoint as it is
        from . import trtllm_build, multimodal

        table = multimodal.prompt_table(component)  # an encoder fills its prompt table (llava)
        return trtllm_build.compile(artifact, ctx, lora=component.options.get("lora"),
                              prompt_table_rows=table["rows"] if table else 0)

    @hookimpl
    def forge_emit_config(self, component, artifact, ctx):
        if not self._mine(component):
            return None
        if ctx.target == "hf-pipeline":
            from . import hfpipeline

            return hfpipeline.emit(component, ctx)
        if ctx.target == "vllm":
            from . import vllm_target

            return vllm_target.emit(component, artifact, ctx)
        from . import decoder_models

        return decoder_models.emit(self.adapter, component, artifact, ctx)

    @hookimpl
    def forge_ensemble_edges(self, components, models, ctx):
        from . import decoder_models

        return [edge for c in components if self._mine(c) and ctx.spec.target not in ("hf-pipeline", "vllm")
                for edge in decoder_models.edges(c, models, ctx)]


def _llmapi(ctx) -> bool:
    """Whether the build's backend release writes the LLM-API layout (no engine, model.yaml)."""
    from .interface import profile_of

    return profile_of(ctx.spec).llmapi
