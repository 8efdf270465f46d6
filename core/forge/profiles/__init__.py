"""tensorrtllm_backend / TensorRT-LLM releases as data: the tensors, parameters and container of each version.

Each :class:`Release` row lists what changed against the row before it (tensors added, dropped,
retyped or renamed; parameters added, dropped or given new defaults). Folding the rows from the
oldest gives the complete :class:`Profile` of every version, so supporting a new backend release
means adding one row at the end of its table. Building (``forge.llm``) and serving (``forge.serving``)
both read this room; it imports nothing of either.

Two layouts (``Profile.layout``): the engine releases (:mod:`.engine`, v0.5.0 … v1.0.0) write the C++
backend's ``inflight_batcher_llm`` repository around a TensorRT engine; the releases after TensorRT-LLM
removed its engine backend (:mod:`.llmapi`) write one python-backend ``tensorrt_llm`` model driving the
LLM API, configured by ``1/model.yaml``. The newest release is the default.

Tensor routing is part of the data: an input ``feed`` names the ensemble input that feeds it,
``src`` the ``model.output`` that produces it; an output ``out`` names the ensemble output it
becomes. The ensemble of a profile is therefore derived, never listed twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from ..errors import UsageError
from .engine_releases import BUILD_FLAGS, ENGINE_RELEASES
from .llmapi_releases import LLMAPI_RELEASES
from .vocabulary import (ENCODER_FEATURES, ENGINE, LAYOUTS, LLMAPI, LOGITS, MODELS, PROMPT_TABLE, YAML, Add,
                         Batching, Change, Drop, DropParam, Interface, Parameter, Profile, Release, Rename, SetParam,
                         Tensor, add, change, drop, flag, i, number, o, param, parse_version)

RELEASES: tuple[Release, ...] = ENGINE_RELEASES + LLMAPI_RELEASES

# -- folding rows into profiles -----------------------------------------------------------------

def _split(path: str) -> tuple[str, bool, str]:
    model, side, name = path.split(".", 2)
    if side not in ("in", "out"):
        raise ValueError(f"bad tensor path {path!r}: expected model.in.NAME or model.out.NAME")
    return model, side == "out", name


def _apply(models: dict[str, list[Tensor]], params: dict[tuple[str, str], Parameter],
           batching: set[str], edit: Any, version: str) -> None:
    if isinstance(edit, tuple):
        for e in edit:
            _apply(models, params, batching, e, version)
        return
    if isinstance(edit, Add):
        tensors = models.setdefault(edit.model, [])
        if any(t.name == edit.tensor.name and t.output == edit.tensor.output for t in tensors):
            raise ValueError(f"{version}: {edit.model} already has {edit.tensor.name}")
        tensors.append(edit.tensor)
    elif isinstance(edit, (Drop, Change, Rename)):
        model, output, name = _split(edit.path)
        tensors = models.get(model, [])
        index = next((n for n, t in enumerate(tensors) if t.name == name and t.output == output), None)
        if index is None:
            raise ValueError(f"{version}: {edit.path} does not exist")
        if isinstance(edit, Drop):
            del tensors[index]
        elif isinstance(edit, Change):
            fields = dict(edit.fields)
            for key in ("feed", "out"):  # True: the ensemble tensor has the model tensor's name
                if fields.get(key) is True:
                    fields[key] = name
            tensors[index] = replace(tensors[index], **fields)
        else:
            old = tensors[index]
            feed = edit.new if edit.feed and old.feed == old.name else old.feed
            out = edit.new if edit.feed and old.out == old.name else old.out
            tensors[index] = replace(old, name=edit.new, feed=feed, out=out)
    elif isinstance(edit, SetParam):
        params[(edit.parameter.model, edit.parameter.key)] = edit.parameter
    elif isinstance(edit, DropParam):
        if params.pop((edit.model, edit.key), None) is None:
            raise ValueError(f"{version}: parameter {edit.model}.{edit.key} does not exist")
    elif isinstance(edit, Batching):
        (batching.add if edit.enabled else batching.discard)(edit.model)
    else:
        raise TypeError(f"{version}: unknown edit {edit!r}")


def build(releases: Iterable[Release] = RELEASES) -> dict[str, Profile]:
    """Fold the release rows, oldest first, into one complete profile per version."""
    models: dict[str, list[Tensor]] = {}
    params: dict[tuple[str, str], Parameter] = {}
    batching: set[str] = set()
    profiles: dict[str, Profile] = {}
    layout = ENGINE
    for release in releases:
        if release.layout != layout:  # a new kind of repository: nothing carries over
            models, params, batching, layout = {}, {}, set(), release.layout
        for edit in release.changes:
            _apply(models, params, batching, edit, release.version)
        profiles[release.version] = Profile(
            version=release.version, triton=release.triton,
            models=tuple((m, Interface(tuple(t for t in ts if not t.output), tuple(t for t in ts if t.output)))
                         for m, ts in models.items()),
            parameters=tuple(params.values()), dynamic_batching=frozenset(batching),
            aliases=release.aliases, notes=release.notes, layout=release.layout)
    return profiles


PROFILES: Mapping[str, Profile] = build()
NEWEST = RELEASES[-1].version


def known() -> list[str]:
    """Every backend version forge has a profile for, oldest first."""
    return list(PROFILES)


def resolve(version: str | None) -> Profile:
    """The profile for ``--backend-version`` (a version like v0.13.0 / 0.13.0, or an NGC tag like 24.09)."""
    if version is None or version in ("", "latest", "newest"):
        return PROFILES[NEWEST]
    wanted = version.strip()
    candidates = (wanted, f"v{wanted}")
    for profile in PROFILES.values():
        if profile.version in candidates or wanted == profile.triton or wanted in profile.aliases \
                or wanted == profile.container:
            return profile
    listed = ", ".join(f"{p.version} ({p.triton})" for p in PROFILES.values())
    raise UsageError(f"unknown --backend-version {version!r}; known: {listed}")


@dataclass(frozen=True)
class Routes:
    """The ensemble wiring of a profile, by model role (not yet by Triton model name)."""

    feeds: tuple[tuple[str, str, str], ...] = field(default=())  # (ensemble input, model, tensor)
    links: tuple[tuple[str, str, str, str], ...] = field(default=())  # (model, output, model, input)
    results: tuple[tuple[str, str, str], ...] = field(default=())  # (model, output, ensemble output)


def routes(profile: Profile, *, include: Any = lambda model, tensor: True) -> Routes:
    """The ensemble routes of ``profile`` for the tensors ``include(model, tensor)`` keeps."""
    feeds, links, results = [], [], []
    for model in ("preprocessing", "tensorrt_llm", "postprocessing"):
        spec = profile.interface(model)
        for t in spec.inputs:
            if not include(model, t):
                continue
            if t.feed:
                feeds.append((t.feed, model, t.name))
            if t.src:
                src_model, src_tensor = t.src.split(".", 1)
                produced = profile.interface(src_model).output(src_tensor)
                if produced is not None and include(src_model, produced):
                    links.append((src_model, src_tensor, model, t.name))
        for t in spec.outputs:
            if t.out and include(model, t):
                results.append((model, t.name, t.out))
    return Routes(tuple(feeds), tuple(links), tuple(results))
