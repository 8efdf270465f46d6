"""Plugin discovery: built-in and third-party families load through the same entry-point group."""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, NamedTuple

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

    def plugin_version(self, family: str) -> str:
        return self.infos[self.family(family).plugin].version


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("forge")
    pm.add_hookspecs(hookspecs)
    return pm


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


UNKNOWN_DISTRIBUTION, UNKNOWN_VERSION = "<unknown distribution>", "0"  # where the metadata does not say


class EntryPoint(NamedTuple):
    """One installed ``forge.plugins`` entry point: ``name = module:attr`` of a distribution."""

    name: str
    value: str
    distribution: str = UNKNOWN_DISTRIBUTION
    version: str = UNKNOWN_VERSION

    def load(self) -> Any:
        """Import the module and follow the attribute path (extras in ``[...]`` are not forge's concern)."""
        module, _, attrs = self.value.partition(":")
        target = importlib.import_module(module.strip())
        for attr in filter(None, attrs.partition("[")[0].strip().split(".")):
            target = getattr(target, attr)
        return target


def iter_entry_points() -> list[EntryPoint]:
    """The installed ``forge.plugins`` entry points, by name.

    Read straight from the distributions' ``*.dist-info`` / ``*.egg-info`` directories on
    ``sys.path``, as ``importlib.metadata`` finds them (the first distribution of a name wins):
    importing ``importlib.metadata`` and its ``email`` parser costs ~25 ms of every command
    (measured). Where the path holds something this scan does not read (a zip archive, an egg) or
    an import hook lists distributions of its own, ``importlib.metadata`` answers instead.
    """
    found = _scan(sys.path)
    if found is None:
        found = _from_importlib_metadata()
    return sorted(found, key=lambda ep: ep.name)


def _scan(path: Iterable[str]) -> list[EntryPoint] | None:
    from importlib.machinery import PathFinder

    if any(hasattr(finder, "find_distributions") and finder is not PathFinder for finder in sys.meta_path):
        return None
    found: list[EntryPoint] = []
    seen: set[str] = set()
    for root in path:
        try:
            children = os.listdir(root or ".")
        except OSError:
            if os.path.isfile(root):
                return None  # a zip archive
            continue
        if os.path.basename(root).lower().endswith(".egg"):
            return None
        for info in children:
            low = info.lower()
            if not low.endswith((".dist-info", ".egg-info")):
                continue
            name = re.sub(r"[-_.]+", "_", low.rpartition(".")[0].partition("-")[0])  # as importlib.metadata does
            if name in seen:
                continue
            seen.add(name)
            text = _read(os.path.join(root, info, "entry_points.txt"))
            points = list(_group(text, ENTRY_POINT_GROUP)) if text else []
            if points:
                dist, version = _name_and_version(os.path.join(root, info))
                found += [EntryPoint(ep_name, value, dist, version) for ep_name, value in points]
    return found


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _group(text: str, group: str) -> Iterator[tuple[str, str]]:
    """The ``name = value`` lines of one ``[group]`` of an entry_points.txt."""
    section = None
    for line in filter(None, map(str.strip, text.splitlines())):
        if line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]")
        elif section == group:
            name, equals, value = line.partition("=")
            if not equals:
                raise PluginError(f"entry point line {line!r} in group {group} has no '='")
            yield name.strip(), value.strip()


def _name_and_version(info: str) -> tuple[str, str]:
    """Name and Version from the core metadata headers (METADATA, or PKG-INFO of an egg-info)."""
    headers: dict[str, str] = {}
    for line in (_read(os.path.join(info, "METADATA")) or _read(os.path.join(info, "PKG-INFO")) or "").splitlines():
        if not line.strip():
            break
        key, colon, value = line.partition(":")
        if colon and key in ("Name", "Version"):
            headers.setdefault(key, value.strip())
    return headers.get("Name", UNKNOWN_DISTRIBUTION), headers.get("Version", UNKNOWN_VERSION)


def _from_importlib_metadata() -> list[EntryPoint]:
    from importlib import metadata

    found = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        meta = ep.dist.metadata if ep.dist is not None else {}
        found.append(EntryPoint(ep.name, ep.value, meta.get("Name") or UNKNOWN_DISTRIBUTION,
                                meta.get("Version") or UNKNOWN_VERSION))
    return found


def load_registry(extra: Iterable[tuple[str, Any]] = (), *, entry_points: bool = True) -> Registry:
    """Load every ``forge.plugins`` entry point (minus blocked ones) plus ``extra`` plugins.

    ``extra`` is ``(name, plugin_object)`` pairs registered in-process, used by tests and by
    applications embedding forge. Unknown hook names (typos) are rejected by ``check_pending``.
    """
    pm = new_plugin_manager()
    infos: dict[str, PluginInfo] = {}
    blocked = _disabled()
    if entry_points:
        for ep in iter_entry_points():
            if ep.name in blocked:
                continue
            dist, version = ep.distribution, ep.version
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
        infos[name] = PluginInfo(name, "<in-process>", getattr(plugin, "__version__", UNKNOWN_VERSION))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {exc.plugin!r} implements an unknown hook: {exc}") from exc
    return Registry(pm, infos)


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
