"""forge build: export, quantize, compile and write a complete Triton model repository."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..spec import BuildSpec, Limits

HELP = "build a complete Triton model repository from a checkpoint"


def _option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    lowered = value.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", action="append", default=[], metavar="NAME",
                   help="model family (repeat, or comma-separate, for a multi-model repository)")
    p.add_argument("--model", action="append", default=[], metavar="DIR|FAMILY=DIR",
                   help="checkpoint directory; FAMILY=DIR gives one family its own checkpoint")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--dtype", default=None, help="weights dtype: float32, float16, bfloat16 (the family's list; "
                   "default float16, but float32 for an encoder's python target where ONNX Runtime has no GPU)")
    p.add_argument("--quant", action="append", default=[], metavar="MODE",
                   help="quantization (repeat or comma-separate), e.g. w8a16, w4a16, int4_awq, fp8, int8_kv, int8")
    p.add_argument("--target", default=None, help="compile target, e.g. tensorrtllm, tensorrt, onnxruntime, python "
                   "(default: the family's; 'forge plugins' lists each family's)")
    p.add_argument("--backend-version", default=None, metavar="X",
                   help="tensorrtllm_backend profile, e.g. v0.5.0, v0.13.0 (default: newest)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help=f"default {Limits.max_batch_size}; the LLM-API layout leaves it to TensorRT-LLM unless given")
    p.add_argument("--max-input-len", type=int, default=None, help=f"default {Limits.max_input_len} (as above)")
    p.add_argument("--max-seq-len", type=int, default=None, help=f"default {Limits.max_seq_len} (as above)")
    p.add_argument("--max-num-tokens", type=int, default=None)
    p.add_argument("--max-beam-width", type=int, default=1)
    p.add_argument("-o", "--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                   help="family option; 'forge options --family NAME' lists them; repeatable")
    p.add_argument("--name-prefix", default="", help="prefix for every Triton model name")
    p.add_argument("--dry-run", action="store_true", help="print the plan and external commands; build nothing")
    p.add_argument("--allow-pickle", action="store_true", help="allow loading pickle checkpoints (pytorch_model.bin)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow checkpoints that need custom code")
    p.add_argument("--json", action="store_true", help="print the result as json")
    _add_option_flags(p)


# Values of the flags that set family options go under this prefix, apart from the command's own arguments.
_FLAG_DEST = "option:"
_FLAG_TYPES = {"int": int, "float": float, "path": Path}


def _add_option_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``Option(flag=…)`` that an installed family declares (``--instances 2`` is ``-o instances=2``)."""
    from ..contract import flags
    from ..errors import PluginError
    from ..registry import registry

    group = p.add_argument_group("family options", "flags the families declare; each sets the option of that "
                                 "name, as -o NAME=VALUE does ('forge options --family NAME')")
    for flag, option in flags(registry().families.values()).items():
        kind = ({"action": "store_const", "const": True} if option.kind == "bool" else
                {"choices": option.choices} if option.kind == "choice" else
                {"type": _FLAG_TYPES.get(option.kind, str), "action": "append" if option.repeat else "store",
                 "metavar": {"int": "N", "float": "X", "path": "PATH"}.get(option.kind, option.name.upper())})
        try:
            group.add_argument(flag, dest=_FLAG_DEST + option.name, default=None, help=option.help, **kind)
        except argparse.ArgumentError:
            raise PluginError(f"family option {option.name!r} declares {flag}, which forge {p.prog.split()[-1]} "
                              "already has", hint="declare another flag, or none (-o sets it too)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_build_arguments(p)


def _split(values: list[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def spec_from_args(args: argparse.Namespace) -> BuildSpec:
    families = _split(args.family)
    model: Path | None = None
    models: dict[str, Path] = {}
    for value in args.model:
        family, sep, path = value.partition("=")
        if sep and family in families:
            models[family] = Path(path)
        elif model is None:
            model = Path(value)
        else:
            raise UsageError("--model given twice; use FAMILY=DIR to give families their own checkpoints")
    if model is None:
        missing = [f for f in families if f not in models]
        if missing or not families:
            raise UsageError("--model is required")
        model = models[families[0]]
    options = dict(args.option)
    for dest, value in vars(args).items():
        if dest.startswith(_FLAG_DEST) and value is not None:
            options.setdefault(dest.removeprefix(_FLAG_DEST), value)  # -o KEY=VALUE wins over the flag
    return BuildSpec(
        families=families, model=model, models=models, out=args.out, tp=args.tp, pp=args.pp,
        dtype=args.dtype or BuildSpec.dtype, dtype_given=args.dtype is not None, quant=tuple(_split(args.quant)),
        target=args.target,
        backend_version=_release(args.backend_version),
        limits=_limits(args),
        options=options, name_prefix=args.name_prefix, dry_run=args.dry_run,
        allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code)


def _release(value: str | None) -> str | None:
    """``--backend-version`` as the release it names (v0.13.0, 24.09, latest …); None: the newest."""
    if value is None:
        return None
    from ..profiles import resolve

    return resolve(value).version


def _limits(args: argparse.Namespace) -> Limits:
    """The size limits, remembering which were given (a layout may leave the others to the runtime)."""
    names = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")
    given = tuple(n for n in names if getattr(args, n) is not None)
    values = {n: getattr(args, n) for n in given}
    if "max_seq_len" in values and "max_input_len" not in values and values["max_seq_len"] <= Limits.max_input_len:
        values["max_input_len"] = max(1, values["max_seq_len"] // 2)  # the defaults' share: half for the prompt
    return Limits(**values, max_beam_width=args.max_beam_width, given=given)


def print_plan(plans: list, out: Path) -> None:
    print(f"plan for {out}:")
    for plan in plans:
        c = plan.component
        print(f"  {c.name} (family {c.family}, role {c.role}, target {plan.target}) from {c.source}")
        for record in plan.records:
            print(f"    {record.stage}")
            for command in record.commands:
                print(f"      $ {shlex.join(command)}")


def run(args: argparse.Namespace) -> int:
    from ..driver import Driver
    from ..registry import registry
    from ..ui import Progress, emit_json

    spec = spec_from_args(args)
    driver = Driver(registry(), log=Progress(quiet=args.json))
    result = driver.build(spec)
    if spec.dry_run:
        if args.json:
            emit_json(result.manifest)
        else:
            print_plan(result.plans, spec.out)
        return 0
    if args.json:
        emit_json({"out": str(result.out), "up_to_date": result.up_to_date, "models": result.models})
    else:
        state = "up to date" if result.up_to_date else "built"
        print(f"{result.out}: {state} ({', '.join(result.models)})")
    return 0
