"""forge options: the ``-o`` keys a family reads, per target, with type, default and help."""

from __future__ import annotations

import argparse

HELP = "list a family's -o build options (what fill_template.py keys become)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", required=True, metavar="NAME", help="the family whose options to list")
    p.add_argument("--target", default=None, metavar="T", help="only the options this target reads")
    p.add_argument("--backend-version", default=None, metavar="X",
                   help="decoders: the options of this release (default: every release's; the newest writes model.yaml)")
    p.add_argument("--json", action="store_true", help="print as json")


def run(args: argparse.Namespace) -> int:
    from ..contract import describe
    from ..errors import UsageError
    from ..registry import registry
    from ..ui import emit_json

    family = registry().family(args.family)
    if args.target is not None and args.target not in family.targets:
        raise UsageError(f"family {family.name!r} has no --target {args.target}; "
                         f"its targets: {', '.join(family.targets)}")
    rows = describe(family, args.target)
    layout = ""
    if family.kind == "decoder" and args.target == "vllm":
        layout = "; Triton's vLLM backend (-o keys of model.json, vLLM's engine arguments)"
    elif family.kind == "decoder":
        from .. import profiles

        profile = profiles.resolve(args.backend_version)
        if args.backend_version is not None:
            names = {p.name for p in profile.parameters if not p.fixed} | _forge_options()
            if profile.llmapi:
                from ..llm.llmapi import NO_EFFECT

                names -= set(NO_EFFECT.get(args.target or "tensorrtllm", {}))
            rows = [r for r in rows if r["name"] in names]
        layout = (f"; {profile.version} writes the LLM-API layout (-o keys of model.yaml)" if profile.llmapi else
                  f"; {profile.version} writes the engine layout (-o keys of config.pbtxt parameters)")
    if args.json:
        emit_json(rows)
        return 0
    scope = f"--target {args.target}" if args.target else f"targets {', '.join(family.targets)}"
    print(f"family {family.name} ({scope}): {len(rows)} options, set with -o KEY=VALUE{layout}")
    width = max((len(r["name"]) for r in rows), default=0)
    for r in rows:
        kind = "|".join(r["choices"]) if r["choices"] else r["kind"]
        default = "-" if r["default"] is None else str(r["default"]).lower() if isinstance(r["default"], bool) \
            else str(r["default"])
        where = "" if args.target or set(r["targets"]) == set(family.targets) else f" [{', '.join(r['targets'])}]"
        flag = f" (also {r['flag']})" if r["flag"] else ""
        print(f"  {r['name']:<{width}}  {kind} = {default}{where}  {r['help']}{flag}")
    return 0


def _forge_options() -> set[str]:
    """forge's own -o options of the decoders (every release takes them)."""
    from ..llm.decoder_options import FORGE, LORA

    return {o.name for o in FORGE} | {LORA.name}
