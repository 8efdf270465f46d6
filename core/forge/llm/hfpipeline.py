"""``--target hf-pipeline``: the plain Hugging Face model on Triton, as a baseline forge builds.

One python-backend model named like the decoder's ensemble (``<prefix>ensemble``) that runs the
Hugging Face ``text-generation`` pipeline per request (``forge.in_triton.hf_pipeline``), with the usual
hand-written deployment choices: no dynamic batching (``max_batch_size`` 0), one instance, ``--dtype`` (float16 by
default), torch's default threads. ``forge bench --compare`` measures an
optimized build against it without anyone writing a model. Nothing is exported or compiled: the
repository links the checkpoint's own files.
"""

from __future__ import annotations

from pathlib import Path

from ..components import Artifact, Component, TritonModel
from ..errors import UsageError
from ..spec import Limits
from .. import in_triton
from .. import tritonconfig as tc
from .pytarget import WEIGHTS_DIR, weight_files

TARGET = "hf-pipeline"
ARTIFACT_KIND = "hf-checkpoint"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "chat_template.jinja")


def check_spec(spec) -> None:
    """What a plain pipeline cannot do, refused before any file is written."""
    if spec.quant:
        raise UsageError(f"--target {TARGET} serves the checkpoint's own weights and cannot apply --quant "
                         f"{','.join(spec.quant)}", hint="drop --quant, or build --target tensorrtllm")
    if spec.limits.max_beam_width > 1:
        raise UsageError(f"--target {TARGET} generates greedily", hint="use --max-beam-width 1")
    default = Limits()
    given = [f"--{name.replace('_', '-')}" for name in ("max_batch_size", "max_input_len", "max_seq_len",
                                                        "max_num_tokens")
             if getattr(spec.limits, name) != getattr(default, name)]
    if given:
        raise UsageError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect on --target {TARGET}: "
                         "the pipeline model batches nothing and generates within the model's own limits",
                         hint="drop them")


def export(source: Path, ctx) -> Artifact:
    """No conversion: the artifact records the source; the repository links its files."""
    from ..hf import inspect_checkpoint

    checkpoint = inspect_checkpoint(source, allow_pickle=ctx.spec.allow_pickle,
                                    trust_remote_code=ctx.spec.trust_remote_code)
    architecture = (checkpoint.config.get("architectures") or [""])[0]
    ctx.note("export", {"format": "hugging face checkpoint, served as it is", "architecture": architecture})
    return Artifact(ARTIFACT_KIND, ctx.workdir, {"architecture": architecture, "source": str(source)})


def emit(component: Component, ctx) -> list[TritonModel]:
    spec = ctx.spec
    check_spec(spec)
    config = tc.model_config(
        component.ensemble, backend="python", max_batch_size=0,
        inputs=[tc.model_input("text_input", "STRING", [1]), tc.model_input("max_tokens", "INT32", [1]),
                tc.model_input("bad_words", "STRING", [-1], optional=True),
                tc.model_input("stop_words", "STRING", [-1], optional=True),
                tc.model_input("exclude_input_in_output", "BOOL", [1], optional=True)],
        outputs=[tc.model_output("text_output", "STRING", [-1])],
        parameters={"forge_target": TARGET, "weights": WEIGHTS_DIR, "dtype": spec.dtype,
                    "device": ctx.option("device", "auto"), "cpu_threads": ctx.option("cpu_threads", 0)},
        instances=int(ctx.option("instances", 1)), instance_kind="KIND_CPU", dynamic_batching=False)
    files: dict[str, Path | bytes] = {"1/model.py": in_triton.HF_PIPELINE.read_bytes(), **in_triton.glue_files(),
                                      **weight_files(component.source)}
    for name in _TOKENIZER_FILES:
        if (component.source / name).is_file():
            files[f"1/{WEIGHTS_DIR}/{name}"] = component.source / name
    ctx.log(f"{component.ensemble}: the Hugging Face text-generation pipeline per request ({spec.dtype}, "
            "no dynamic batching, one instance)")
    return [TritonModel(config, files)]
