"""A build spec checked against the contracts of the families it builds, before any stage runs.

Each :class:`~forge.components.Family` declares its targets, dtypes, quantization modes, the
targets on which ``--tp``/``--pp`` mean something, and every ``-o`` option it reads. The driver
asks :func:`check` once per build: whatever a family did not declare is refused here, so no option,
flag or parallel size is ever silently dropped. The options' declarations are the only statement of
their rules: :func:`check_value` reads kind, choices and bounds from them, :func:`flags` gives the CLI
its first-class flags.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Sequence

from .components import Family, Option
from .errors import PluginError, UsageError
from .spec import BuildSpec


def _label(option: Option) -> str:
    """How the user wrote an option: its flag (``--instances``) or ``-o name``."""
    return option.flag or f"-o {option.name}"


def _choice_text(value: Any) -> str:
    """A choice as written: ``-o key=true`` arrives as the boolean True, which stands for the choice "true"."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_value(option: Option, value: Any) -> None:
    """Refuse a value that does not fit the option's kind, choices or bounds."""
    label, kind = _label(option), option.kind
    if kind == "bool":
        if not (isinstance(value, bool) or str(value).strip().lower() in ("true", "false", "1", "0")):
            raise UsageError(f"{label} takes true or false, got {value!r}")
    elif kind in ("int", "float"):
        number = (int,) if kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number):
            raise UsageError(f"{label} takes {'an integer' if kind == 'int' else 'a number'}, got {value!r}"
                             f" ({option.help})")
        _check_bounds(option, label, value)
    elif kind == "choice":
        if _choice_text(value) not in option.choices:
            raise UsageError(f"{label}={value} is not valid; choose one of {', '.join(option.choices)}")
    elif kind == "path":
        if not isinstance(value, (str, Path)) or not str(value):
            raise UsageError(f"{label} takes a path, got {value!r}")


def _check_bounds(option: Option, label: str, value: float) -> None:
    if option.minimum is not None and value < option.minimum:
        raise UsageError(f"{label} must be at least {option.minimum:g}, got {value!r}")
    above = option.exclusive_minimum
    if above is not None and value <= above:
        positive = f"a positive {'integer' if option.kind == 'int' else 'number'}"
        raise UsageError(f"{label} must be {positive if above == 0 else f'greater than {above:g}'}, got {value!r}")


def flags(families: Iterable[Family]) -> dict[str, Option]:
    """The first-class flags the families declare (``Option(flag=…)``): flag → option, with every family's help.

    Families that share a flag must declare the same option under it (name, kind, choices, repetition).
    """
    declared: dict[str, list[tuple[Family, Option]]] = {}
    for family in families:
        for option in family.options:
            if option.flag:
                declared.setdefault(option.flag, []).append((family, option))
    result = {}
    for flag, pairs in declared.items():
        first_family, first = pairs[0]
        for family, option in pairs[1:]:
            if _shape(option) != _shape(first):
                raise PluginError(f"families {first_family.name!r} and {family.name!r} declare {flag} differently "
                                  f"({_described(first)}; {_described(option)})",
                                  hint="a flag is one option: give the same name, kind and choices, or another flag")
        helps: dict[str, list[str]] = {}
        for family, option in pairs:
            helps.setdefault(option.help, []).append(family.name)
        text = first.help if len(helps) == 1 else "; ".join(f"{', '.join(names)}: {help}"
                                                            for help, names in helps.items())
        result[flag] = dataclasses.replace(first, help=text)
    return result


def _shape(option: Option) -> tuple:
    """What a flag's parser depends on."""
    return option.name, option.kind, option.choices, option.repeat


def _described(option: Option) -> str:
    choices = f" of {'|'.join(option.choices)}" if option.choices else ""
    return f"-o {option.name}: {option.kind}{choices}{', repeatable' if option.repeat else ''}"


def _unknown(name: str, known: Iterable[str], families: Sequence[Family]) -> UsageError:
    names = ", ".join(f.name for f in families)
    elsewhere = _declared_elsewhere(name)
    if elsewhere is not None:
        family, option = elsewhere
        label = _label(option)
        joins = [_label(o) for o in family.options if o.name in family.joins_on]
        if joins:  # read by a family that joins builds on an option the build lacks (--collection without --store)
            return UsageError(f"{label} needs {' or '.join(joins)} (it is read by family {family.name}, which "
                              f"{' or '.join(joins)} adds to a build)")
        if option.flag:
            return UsageError(f"{label} does not apply to family {names}",
                              hint="drop it (see 'forge options --family NAME')")
    import difflib  # only on a misspelt key: not part of every command's start-up

    known = sorted(set(known))
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    guess = f"did you mean {' or '.join(close)}? " if close else ""
    listing = ", ".join(known) if len(known) <= 40 else ", ".join(known[:40]) + ", …"
    return UsageError(f"unknown -o {name} for family {names}; {guess}valid keys: {listing or 'none'}",
                      hint="'forge options --family NAME [--target T]' lists them with their help")


def _declared_elsewhere(name: str) -> tuple[Family, Option] | None:
    """A registered family that declares ``-o name`` (none of the build's does), and its declaration."""
    from .registry import registry  # only on a refused option: the families outside the build

    for family in registry().families.values():
        option = family.option(name)
        if option is not None:
            return family, option
    return None


def check_options(spec: BuildSpec, builds: Sequence[tuple[Family, str]]) -> None:
    """Every ``-o`` key (and option-setting flag) must be read by some family of the build for its target."""
    families = [family for family, _ in builds]
    for name, value in spec.options.items():
        declared = [(family, target, family.option(name)) for family, target in builds if family.option(name)]
        if not declared:
            raise _unknown(name, (o.name for f in families for o in f.options), families)
        using = [(family, target, option) for family, target, option in declared if option.used_by(target)]
        if not using:
            family, target, option = declared[0]
            raise UsageError(f"{_label(option)} has no effect on --target {target} of family {family.name}; "
                             f"it is read by --target {', '.join(option.targets)}",
                             hint=f"drop it, or build --target {option.targets[0]}")
        for _, _, option in using:
            check_value(option, value)
        if any(option.kind == "choice" for _, _, option in using):
            spec.options[name] = _choice_text(value)  # what every reader compares with: the choice as written
        parse = next((option.parse for _, _, option in using if option.parse is not None), None)
        if parse is not None:
            spec.options[name] = parse(value)  # what every reader reads: the family's form of the value


def check(spec: BuildSpec, builds: Sequence[tuple[Family, str]]) -> None:
    """Check dtype, quantization, parallelism and options of ``spec`` against each (family, target)."""
    for family, target in builds:
        name = family.name
        if target not in family.targets:
            raise UsageError(f"family {name!r} cannot be built for --target {target}; "
                             f"its targets: {', '.join(family.targets)}")
        if family.joins_on and name not in spec.families:
            continue  # joined on an option: it converts no weights
        if spec.dtype not in family.dtypes:
            raise UsageError(f"family {name!r} does not support --dtype {spec.dtype}; "
                             f"choose one of {', '.join(family.dtypes)}")
        for quant in spec.quant:
            if quant not in family.quants:
                known = ", ".join(family.quants) or "none"
                raise UsageError(f"family {name!r} does not support --quant {quant}; supported: {known}")
        if spec.world_size > 1 and target not in family.parallel_targets:
            where = (f"only on --target {', '.join(family.parallel_targets)}" if family.parallel_targets
                     else "on no target: it runs as one copy per instance")
            raise UsageError(f"family {name!r} cannot split across ranks for --target {target} "
                             f"(--tp {spec.tp} --pp {spec.pp}); it runs tensor/pipeline parallel {where}",
                             hint="drop --tp/--pp" if not family.parallel_targets else
                             f"drop --tp/--pp, or build --target {family.parallel_targets[0]}")
    check_options(spec, builds)


def describe(family: Family, target: str | None = None) -> list[dict[str, Any]]:
    """The family's options (for ``target`` only, when given) as json-able rows."""
    options = family.options if target is None else family.options_for(target)
    return [{"name": o.name, "kind": o.kind, "default": o.default, "help": o.help,
             "targets": list(o.targets) or list(family.targets), "choices": list(o.choices),
             "flag": o.flag} for o in sorted(options, key=lambda o: o.name)]
