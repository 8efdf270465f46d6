"""A complete, tiny forge plugin: family "toy" (two python models + ensemble). Copy it to start a plugin.

It shows every part of the public plugin API:

* ``forge_register_families`` declares the family's contract as data: the checkpoints it accepts,
  its targets (``echo`` is a target no built-in family knows: a plugin adds targets by naming
  them), dtypes, quantization modes and every ``-o`` option it reads. The driver refuses anything
  outside it (unknown ``-o`` keys, options the chosen target ignores, ``--tp`` without parallelism).
* stage hooks (``forge_export``, ``forge_compile``, ``forge_emit_config``) answer only for the
  family's own components and return plain data (``Artifact``, ``TritonModel``).
* ``forge_ensemble_edges`` wires the models; the driver assembles and validates the ensemble.

Packaged, it is one module plus an entry point (see README "Writing a plugin");
``tests/core/test_thirdparty.py`` pip-installs it that way and builds with ``--target echo``.
"""

from __future__ import annotations

import json
import time

from forge import hookimpl
from forge import tritonconfig as tc
from forge.components import Artifact, Component, Edge, Family, Option, TritonModel

MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.scale = float(__import__("json").loads(args["model_config"])["parameters"]["scale"]["string_value"])

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "{inp}").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("{outp}", (x * self.scale).astype(np.float32))]))
        return out
'''

calls: list[str] = []

OPTIONS = (
    Option("sleep", "float", "seconds each stage waits (lets tests kill a build mid-stage)", 0, minimum=0),
    Option("gain", "float", "extra factor applied by the echo target's main model", 1.0, targets=("echo",)),
)


def _components(spec):
    return [Component(name=f"{spec.name_prefix}toy", family="toy", role="toy", source=spec.source_for("toy"),
                      prefix=spec.name_prefix, ensemble=f"{spec.name_prefix}ensemble")]


@hookimpl
def forge_register_families(register):
    register(Family(name="toy", kind="encoder", description="toy family for tests", architectures=("ToyModel",),
                    targets=("python", "echo"), default_target="python", components=_components,
                    quants=("int8",), options=OPTIONS))


@hookimpl
def forge_export(component, ctx):
    if component.family != "toy":
        return None
    calls.append("export")
    time.sleep(float(ctx.option("sleep", 0)))  # lets tests kill a build mid-stage
    config = json.loads((component.source / "config.json").read_text())
    (ctx.workdir / "exported.json").write_text(json.dumps({"scale": config.get("scale", 2.0)}))
    ctx.note("parity", {"max_abs_diff": 0.0})
    return Artifact("toy-export", ctx.workdir, {"scale": config.get("scale", 2.0)})


@hookimpl
def forge_compile(component, artifact, ctx):
    if component.family != "toy":
        return None
    calls.append("compile")
    return None


@hookimpl
def forge_emit_config(component, artifact, ctx):
    if component.family != "toy":
        return None
    calls.append("emit_config")
    time.sleep(float(ctx.option("sleep", 0)))
    scale = artifact.meta["scale"]
    if ctx.target == "echo":  # the plugin's own target: same models, scaled by -o gain
        scale = scale * float(ctx.option("gain", 1.0))
    pre = tc.model_config(component.model_name("pre"), backend="python", max_batch_size=8,
                          inputs=[tc.model_input("X", "FP32", [-1])], outputs=[tc.model_output("Y", "FP32", [-1])],
                          parameters={"scale": 1.0}, instances=1)
    main = tc.model_config(component.model_name("main"), backend="python", max_batch_size=8,
                           inputs=[tc.model_input("IN", "FP32", [-1])], outputs=[tc.model_output("OUT", "FP32", [-1])],
                           parameters={"scale": scale}, instances=1)
    return [TritonModel(pre, {"1/model.py": MODEL_PY.replace("{inp}", "X").replace("{outp}", "Y")}),
            TritonModel(main, {"1/model.py": MODEL_PY.replace("{inp}", "IN").replace("{outp}", "OUT")})]


@hookimpl
def forge_ensemble_edges(components, models, ctx):
    edges = []
    for c in components:
        if c.family != "toy":
            continue
        pre, main = c.model_name("pre"), c.model_name("main")
        edges += [Edge.feed("input", pre, "X", ensemble=c.ensemble), Edge.link(pre, "Y", main, "IN", ensemble=c.ensemble),
                  Edge.result(main, "OUT", "output", ensemble=c.ensemble)]
    return edges
