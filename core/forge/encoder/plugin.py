"""The hook implementations every encoder family shares; a family plugin is one adapter.

Heavy modules (torch, onnx, onnxruntime) are imported inside the hooks so ``forge plugins`` stays fast.

Naming. Each tower is one component whose Triton models carry its name as prefix:
``minilm_tokenizer`` → ``minilm_encoder``; ``clip_vision_preprocessing`` → ``clip_vision_encoder``;
``clip_text_tokenizer`` → ``clip_text_encoder``. Each tower's pipeline is one ensemble named after
the tower's ``pipeline`` (``minilm``, ``clip_image``, ``clip_text``), except that a family with a
single pipeline built alone names it ``solo_ensemble`` (MiniLM: ``ensemble``, what default
clients call). ``--name-prefix P`` prepends P to every model and ensemble name.
"""

from __future__ import annotations

from pathlib import Path

from forge import hookimpl
from forge.components import Component, Family

from .adapter import EncoderAdapter
from .encoder_options import OPTIONS

TARGETS = ("tensorrt", "onnxruntime", "python")
#: Production wants TensorRT plans on GPUs; on machines without trtexec use --target python/onnxruntime.
DEFAULT_TARGET = "tensorrt"
DTYPES = ("float32", "float16")
QUANTS = ("int8",)


def cpu_float32(spec) -> bool:
    """Whether a build left at the default dtype keeps float32: the python target where this environment's
    ONNX Runtime (the one it is served with) has no GPU provider, or ``-o device=cpu``. float16 runs slower
    than float32 on ONNX Runtime's CPU provider (all-MiniLM-L6-v2 served at concurrency 8 on 2 cores: 235–258
    vs 253–286 sentences/s) and is less exact; ``--dtype float16`` keeps it anyway."""
    if spec.dtype_given or spec.dtype != "float16" or spec.target not in ("python", "onnxruntime"):
        return False
    device = spec.options.get("device", "auto")
    if device != "auto" or spec.target != "python":  # the onnxruntime backend runs where the repository is served
        return device == "cpu"
    return not onnxruntime_has_cuda()


def onnxruntime_has_cuda() -> bool:
    """Whether the installed onnxruntime carries its CUDA provider (``capi/libonnxruntime_providers_cuda.so``, as
    onnxruntime-gpu ships it), found without importing onnxruntime: that import (~0.1 s) would double the
    time of a build whose stages all come from the cache."""
    import importlib.util

    found = importlib.util.find_spec("onnxruntime")
    places = (found.submodule_search_locations or []) if found else []
    return any(any((Path(place) / "capi").glob("*onnxruntime_providers_cuda.*")) for place in places)


class EncoderPlugin:
    """Implements forge's hooks for one encoder family described by ``adapter``."""

    def __init__(self, adapter: EncoderAdapter):
        self.adapter = adapter

    def _mine(self, component: Component) -> bool:
        return component.family == self.adapter.family

    def components(self, spec) -> list[Component]:
        """One component per tower, named as the module docstring explains."""
        a = self.adapter
        alone = spec.families == [a.family]
        options = {"dtype": "float32"} if cpu_float32(spec) else {}
        result = []
        for tower in a.towers:
            name = a.family if len(a.towers) == 1 else f"{a.family}_{tower.role}"
            pipeline = a.solo_ensemble if alone and a.solo_ensemble and len(a.towers) == 1 else tower.pipeline
            result.append(Component(name=f"{spec.name_prefix}{name}", family=a.family, role=tower.role,
                                    source=spec.source_for(a.family), prefix=f"{spec.name_prefix}{name}_",
                                    ensemble=f"{spec.name_prefix}{pipeline}", options=dict(options)))
        return result

    @hookimpl
    def forge_register_families(self, register):
        a = self.adapter
        register(Family(name=a.family, kind="encoder", description=a.description,
                        architectures=a.architectures, targets=TARGETS, default_target=DEFAULT_TARGET,
                        components=self.components, dtypes=DTYPES, quants=QUANTS,
                        options=OPTIONS + a.options))

    @hookimpl
    def forge_export(self, component, ctx):
        if not self._mine(component):
            return None
        from . import onnx_export

        return onnx_export.export(self.adapter, component, ctx)

    @hookimpl
    def forge_quantize(self, component, artifact, ctx):
        if not self._mine(component):
            return None
        from . import onnx_quant

        return onnx_quant.quantize(self.adapter, component, artifact, ctx)

    @hookimpl
    def forge_compile(self, component, artifact, ctx):
        if not self._mine(component) or ctx.target != "tensorrt":
            return None  # onnxruntime and python serve the ONNX file as it is
        from . import tensorrt

        return tensorrt.compile(component, artifact, ctx)

    @hookimpl
    def forge_emit_config(self, component, artifact, ctx):
        if not self._mine(component):
            return None
        from . import tower_models

        return tower_models.emit(component, artifact, ctx)

    @hookimpl
    def forge_ensemble_edges(self, components, models, ctx):
        from . import tower_models

        return [edge for c in components if self._mine(c) for edge in tower_models.edges(c, models)]
