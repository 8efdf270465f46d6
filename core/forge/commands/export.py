"""forge export: run the export stage (and quantize, under --quant) and write its artifact to --out."""

from __future__ import annotations

import argparse

from .build import add_build_arguments, print_plan, spec_from_args

HELP = ("run the export stage (TensorRT-LLM checkpoint, ONNX; quantized under --quant, as build does) "
        "and write it to --out")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_build_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ..driver import Driver
    from ..registry import registry
    from ..ui import Progress, emit_json

    spec = spec_from_args(args)
    if "lora" in spec.options:
        from ..errors import UsageError

        raise UsageError("--lora adapters ship with the repository that forge build writes; forge export writes "
                         "only the checkpoint", hint="drop --lora (trtllm-build --lora_dir takes the PEFT folders)")
    plans = Driver(registry(), log=Progress(quiet=args.json)).export(spec)
    if spec.dry_run:
        print_plan(plans, spec.out)
    elif args.json:
        emit_json({"out": str(spec.out), "artifacts": [p.artifact.to_json() for p in plans]})
    else:
        for plan in plans:
            print(f"{plan.component.name}: {plan.artifact.kind} → {spec.out}")
    return 0
