"""Plugin discovery: built-in and third-party families load through the same entry-point group."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any, Iterable

import pluggy

from . import hookspecs
from .components import Family
from .errors import PluginError, UsageError

ENTRY_POINT_GROUP = "forge.plugins"
DISABLE_ENV = "FORGE_DISABLE_PLUGINS"  # comma-separated entry-point names


@dataclass
class PluginInfo:
    """What ``forge plugins`` shows for one loaded plugin."""

    name: str
    distribution: str
    version: str
    families: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)


class Registry:
    """The loaded plugin manager plus the families plugins registered."""

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, PluginInfo]):
        self.pm = pm
        self.hook = pm.hook
        self.infos = infos
        self.families: dict[str, Family] = {}
        for name, plugin in pm.list_name_plugin():
            info = infos[name]
            info.hooks = sorted({caller.name for caller in pm.get_hookcallers(plugin) or []})

        current: list[str] = []

        def register(family: Family) -> None:
            if not isinstance(family, Family):
                raise PluginError(f"plugin {current[0]!r} registered {family!r}, not a forge.components.Family")
            if family.name in self.families:
                raise PluginError(f"family {family.name!r} is registered by both "
                                  f"{self.families[family.name].plugin!r} and {current[0]!r}")
            self.families[family.name] = replace(family, plugin=current[0])
            infos[current[0]].families.append(family.name)

        # Call each plugin's registration separately so the registry knows who registered what.
        for name, plugin in pm.list_name_plugin():
            impl = getattr(plugin, "forge_register_families", None)
            if impl is not None:
                current[:] = [name]
                impl(register=register)

    def family(self, name: str) -> Family:
        """The family called ``name``; the error lists the known ones."""
        try:
            return self.families[name]
        except KeyError:
            known = ", ".join(sorted(self.families)) or "none (no plugins loaded)"
            raise UsageError(f"unknown family {name!r}; known families: {known}") from None

    def family_for_architecture(self, architecture: str) -> Family | None:
        for family in self.families.values():
            if architecture in family.architectures:
                return family
        return None

    def plugin_version(self, family: str) -> str:
        return self.infos[self.family(family).plugin].version


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("forge")
    pm.add_hookspecs(hookspecs)
    return pm


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def iter_entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def load_registry(extra: Iterable[tuple[str, Any]] = (), *, entry_points: bool = True) -> Registry:
    """Load every ``forge.plugins`` entry point (minus blocked ones) plus ``extra`` plugins.

    ``extra`` is ``(name, plugin_object)`` pairs registered in-process, used by tests and by
    applications embedding forge. Unknown hook names (typos) are rejected by ``check_pending``.
    """
    pm = new_plugin_manager()
    infos: dict[str, PluginInfo] = {}
    blocked = _disabled()
    if entry_points:
        dists: dict[int, tuple[str, str]] = {}
        for ep in iter_entry_points():
            if ep.name in blocked:
                continue
            dist, version = _distribution(ep, dists)
            try:
                plugin = ep.load()
            except Exception as exc:  # any import-time failure of third-party code
                raise PluginError(
                    f"plugin {ep.name!r} from distribution {dist!r} (entry point "
                    f"{ep.name} = {ep.value}) failed to load: {type(exc).__name__}: {exc}",
                    hint=f"fix or uninstall it, or set {DISABLE_ENV}={ep.name}") from exc
            _register(pm, plugin, ep.name)
            infos[ep.name] = PluginInfo(ep.name, dist, version)
    for name, plugin in extra:
        if name in blocked:
            continue
        _register(pm, plugin, name)
        infos[name] = PluginInfo(name, "<in-process>", getattr(plugin, "__version__", "0"))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {exc.plugin!r} implements an unknown hook: {exc}") from exc
    return Registry(pm, infos)


def _distribution(ep: metadata.EntryPoint, seen: dict[int, tuple[str, str]]) -> tuple[str, str]:
    """(name, version) of the entry point's distribution; its METADATA is parsed once, not per plugin."""
    if ep.dist is None:
        return "<unknown distribution>", "0"
    if id(ep.dist) not in seen:
        meta = ep.dist.metadata  # an email-format parse (milliseconds) on every access
        seen[id(ep.dist)] = (meta["Name"], meta["Version"])
    return seen[id(ep.dist)]


def _register(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    try:
        pm.register(plugin, name=name)
    except ValueError as exc:
        raise PluginError(f"plugin {name!r} could not be registered: {exc}") from exc
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name!r} has an invalid hook implementation: {exc}") from exc


_registry: Registry | None = None


def registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _registry
    if _registry is None:
        _registry = load_registry()
    return _registry


def set_registry(value: Registry | None) -> None:
    """Replace the process-wide registry (tests, embedding applications)."""
    global _registry
    _registry = value
