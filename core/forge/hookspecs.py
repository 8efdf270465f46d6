"""Every hook a forge plugin can implement.

The driver calls the hooks in this order for a build: ``forge_register_families`` once when
plugins load; then, for every component of the pipeline, ``forge_export`` → ``forge_quantize`` →
``forge_compile`` → ``forge_emit_config``; finally ``forge_ensemble_edges`` once for the whole
build, after which the driver assembles, validates and writes the ensembles.

Stage hooks are ``firstresult``: plugins answer only for components of families they own and
return ``None`` otherwise, so the first non-``None`` result is the one from the owning plugin.
A third-party plugin can override a built-in one for the same family by being registered with
``tryfirst=True`` on its hook implementations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from .components import Artifact, Component, Edge, Family, TritonModel
    from .context import BuildContext

hookspec = pluggy.HookspecMarker("forge")


@hookspec
def forge_register_families(register: "Callable[[Family], None]") -> None:
    """Declare the model families this plugin builds, each with its contract.

    Called once by the plugin manager after all plugins are loaded. A :class:`Family` is the
    family's contract as data: accepted architectures, targets (any name the plugin chooses),
    dtypes, quantization modes, the targets with tensor/pipeline parallelism and every ``-o``
    :class:`~forge.components.Option` it reads. The driver checks each build against it before
    any stage hook runs, so stage hooks only see options their family declared for the target.

    :param register: call ``register(Family(...))`` once per family; registering a family name
        that another plugin already registered is an error.
    """


@hookspec(firstresult=True)
def forge_export(component: "Component", ctx: "BuildContext") -> "Artifact | None":
    """Convert the component's source checkpoint into an exportable artifact.

    Called by the driver's export stage. Decoders return a TensorRT-LLM unified checkpoint
    (``config.json`` + ``rank{N}.safetensors``); encoders return parity-checked ONNX graphs.
    Write files only below ``ctx.workdir``; the driver caches and moves the result.

    :param component: the component to export.
    :param ctx: build spec, work directory, progress and manifest recording.
    :return: the artifact, or ``None`` when the component belongs to another plugin's family.
        First non-``None`` result wins.
    """


@hookspec(firstresult=True)
def forge_quantize(component: "Component", artifact: "Artifact",
                   ctx: "BuildContext") -> "Artifact | None":
    """Quantize an exported artifact according to ``ctx.spec.quant``.

    Called by the driver's quantize stage, after export, even when no quantization was asked
    for (the plugin then returns the artifact unchanged or ``None``).

    :return: the quantized artifact, or ``None`` to keep the exported artifact.
        First non-``None`` result wins.
    """


@hookspec(firstresult=True)
def forge_compile(component: "Component", artifact: "Artifact",
                  ctx: "BuildContext") -> "Artifact | None":
    """Compile an artifact for the build target (``trtllm-build``, ``trtexec``, or nothing).

    Called by the driver's compile stage. External tools run through ``ctx.run_tool`` so the
    command line is recorded in the manifest and a missing tool gives a clear error.

    :return: the runnable artifact, or ``None`` when the artifact is already runnable.
        First non-``None`` result wins.
    """


@hookspec(firstresult=True)
def forge_emit_config(component: "Component", artifact: "Artifact",
                      ctx: "BuildContext") -> "list[TritonModel] | None":
    """Describe the Triton models that serve a component.

    Called by the driver after compile. Each :class:`~forge.components.TritonModel` carries a
    ``model_config_pb2.ModelConfig`` and the files of its model directory; the driver writes them.

    :return: the component's Triton models (ensembles excluded), or ``None`` when the component
        belongs to another plugin. First non-``None`` result wins.
    """


@hookspec
def forge_ensemble_edges(components: "list[Component]",
                         models: "dict[str, TritonModel]",
                         ctx: "BuildContext") -> "list[Edge] | None":
    """Declare how tensors flow between the models of the plugin's own components.

    Called once per build after every component's ``forge_emit_config``. The driver collects the
    edges of every plugin, groups them by ``Edge.ensemble``, validates each graph (every required
    input fed, dtypes and dims compatible, no cycle, names exist on both ends) and writes one
    ensemble model per group.

    :param components: every component of the build (plugins pick their own by family).
    :param models: every emitted model by name, so edges can refer to real tensor names.
    :return: the plugin's edges. Results of all plugins are concatenated.
    """
