"""Helpers for testing forge plugins (the way ``pytester`` serves pytest plugins).

    from forge.testing import use_plugins
    with use_plugins(("myfamily", my_plugin_module)):
        assert main(["build", "--family", "myfamily", ...]) == 0
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

from . import registry as plugins
from .registry import Registry, load_registry


def registry_with(*extra: tuple[str, Any], entry_points: bool = False) -> Registry:
    """A registry of the given in-memory plugins (and, if asked, the installed entry points)."""
    return load_registry(extra, entry_points=entry_points)


@contextlib.contextmanager
def use_plugins(*extra: tuple[str, Any], entry_points: bool = False) -> Iterator[Registry]:
    """Make the CLI and driver see exactly these plugins while the block runs."""
    previous = plugins._registry
    reg = registry_with(*extra, entry_points=entry_points)
    plugins.set_registry(reg)
    try:
        yield reg
    finally:
        plugins.set_registry(previous)


class FakeEntryPoint:
    """Stands in for an installed ``forge.plugins`` entry point (a ``forge.registry.EntryPoint``)."""

    def __init__(self, name: str, target: Any, distribution: str = "fake-forge-plugin",
                 version: str = "0.0.0"):
        self.name, self.distribution, self.version = name, distribution, version
        self.value = f"{getattr(target, '__name__', type(target).__name__)}"
        self._target = target

    def load(self) -> Any:
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


@contextlib.contextmanager
def fake_entry_points(*points: FakeEntryPoint, keep_installed: bool = True) -> Iterator[None]:
    """Pretend these entry points are installed (beside the real ones unless told otherwise)."""
    real = plugins.iter_entry_points

    def fake() -> list:
        found = list(real()) if keep_installed else []
        return sorted([*found, *points], key=lambda ep: ep.name)

    previous = plugins._registry
    plugins.set_registry(None)
    with mock.patch.object(plugins, "iter_entry_points", fake):
        try:
            yield
        finally:
            plugins.set_registry(previous)


@contextlib.contextmanager
def serving_environment(cache_dir, **extra: str) -> Iterator[None]:
    """Environment for tests that build and serve: an isolated stage cache, one torch thread per python
    model (several servers and ranks share a small machine), no tokenizer threads; ``extra`` adds
    variables. Everything is restored afterwards."""
    import os

    values = {"FORGE_CACHE_DIR": str(cache_dir), "FORGE_PYTARGET_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              **extra}
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def merge_repositories(repos, out):
    """Copy the models of several repositories into ``out`` (one server for all; names must not clash)."""
    import shutil
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for repo in repos:
        for model_dir in Path(repo).iterdir():
            if model_dir.is_dir():
                shutil.copytree(model_dir, out / model_dir.name)
    return out
