"""The build driver: export → quantize → compile → emit_config → ensembles → validate → write."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__, contract, publish, toolchain
from .cache import StageCache, cache_dir, fingerprint, source_fingerprint
from .components import Artifact, Component, Edge, TritonModel
from .context import BuildContext, StageRecord
from .errors import ForgeError, UsageError, ValidationError
from .registry import Registry
from .spec import BuildSpec, check_name

STAGES = ("export", "quantize", "compile")
_TOOLS_FINGERPRINTED = ("trtllm-build", "trtexec")


@dataclass
class ComponentPlan:
    component: Component
    target: str
    keys: dict[str, str] = field(default_factory=dict)
    records: list[StageRecord] = field(default_factory=list)
    artifact: Artifact | None = None


@dataclass
class BuildResult:
    out: Path
    up_to_date: bool
    plans: list[ComponentPlan]
    models: list[str]
    manifest: dict[str, Any]


Log = Callable[[str], None]


class Driver:
    """Runs builds against a plugin registry."""

    def __init__(self, registry: Registry, *, log: Log = lambda message: None,
                 cache: StageCache | None = None):
        self.registry = registry
        self.log = log
        self.cache = cache or StageCache()

    # -- planning -------------------------------------------------------------------------------
    def plan(self, spec: BuildSpec, stages: tuple[str, ...] = STAGES) -> list[ComponentPlan]:
        """Resolve families, targets and components, and compute every stage's cache key."""
        spec.validate()
        if not spec.families:
            raise UsageError("no --family given; known families: " + ", ".join(sorted(self.registry.families)))
        builds = [(family, spec.target or family.default_target)
                  for family in (self.registry.family(name) for name in spec.families)]
        # Families that join on an option (``--store`` adds retrieval) run on their own default target.
        builds += [(family, family.default_target) for family in self.registry.families.values()
                   if family.name not in spec.families and any(o in spec.options for o in family.joins_on)]
        self._release_for(spec, [family for family, _ in builds])
        contract.check(spec, builds)
        self._spec_json = spec.to_json()  # after the check: choice values as written (-o x=true arrives as True)
        plans: list[ComponentPlan] = []
        for family, target in builds:
            name = family.name
            source = spec.source_for(name)
            if not source.exists():
                raise UsageError(f"model path {source} does not exist")
            if source.is_dir() and not any(source.iterdir()):
                raise UsageError(f"model directory {source} is empty")
            for component in family.components(spec):
                plans.append(ComponentPlan(component, target))
        names = [p.component.name for p in plans]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise UsageError(f"two components are both called {duplicates[0]!r}; give families "
                             "distinct prefixes with --name-prefix or build them separately")
        tools = {tool: toolchain.identity(tool) for tool in _TOOLS_FINGERPRINTED}
        spec_key = {k: v for k, v in spec.to_json().items() if k not in ("out", "dry_run", "model", "models")}
        self._tools = tools
        sources: dict[Path, str] = {}  # components of one checkpoint (CLIP's towers) hash it once
        for plan in plans:
            c = plan.component
            if c.source not in sources:
                sources[c.source] = source_fingerprint(c.source) if c.source.exists() else str(c.source)
            previous = fingerprint(
                "source", sources[c.source],
                c.family, c.name, c.role, dict(c.options), plan.target, spec_key, __version__,
                self.registry.plugin_version(c.family))
            for stage in stages:
                previous = fingerprint(stage, previous, tools if stage == "compile" else None)
                plan.keys[stage] = previous
        return plans

    def _release_for(self, spec: BuildSpec, families) -> None:
        """Without ``--backend-version``: the newest release whose layout every family of the build supports
        (a family that does not build the newest release's layout yet gets the newest one it does), said in the log."""
        if spec.backend_version is not None:
            return
        from . import profiles

        wanted = [f for f in families if f.layouts]
        newest = profiles.resolve(None)
        if all(newest.layout in f.layouts for f in wanted):
            return
        fits = [v for v in profiles.known() if all(profiles.resolve(v).layout in f.layouts for f in wanted)]
        if not fits:
            raise UsageError("the families of this build support no backend release in common: "
                             + ", ".join(f"{f.name} ({', '.join(f.layouts)})" for f in wanted))
        spec.backend_version = fits[-1]
        names = ", ".join(f.name for f in wanted if newest.layout not in f.layouts)
        self.log(f"{names}: built for {fits[-1]}, the newest release whose layout it supports "
                 f"({profiles.resolve(fits[-1]).layout}; {newest.version} writes the {newest.layout} layout)")

    # -- stages ---------------------------------------------------------------------------------
    def _run_stage(self, stage: str, plan: ComponentPlan, spec: BuildSpec,
                   artifact: Artifact | None) -> Artifact | None:
        key = plan.keys[stage]
        record = StageRecord(stage, key)
        plan.records.append(record)
        passthrough = self.cache.is_passthrough(key)
        cached = None if passthrough else self.cache.get(key)
        if passthrough or cached is not None:
            record.cached = True
            saved = self.cache.root / key / "record.json"
            if saved.is_file():
                data = json.loads(saved.read_text())
                record.commands, record.notes = data.get("commands", []), data.get("notes", {})
            self.log(f"{plan.component.name}: {stage} (cached)")
            return artifact if passthrough else cached
        if spec.dry_run:
            # The plan shows the paths a real build will use (the entry is not in the cache, or the
            # lookup above would have answered); whatever a plugin writes there is removed again.
            workdir = self.cache.root / key / "data"
            shutil.rmtree(workdir.parent, ignore_errors=True)
            workdir.mkdir(parents=True)
        else:
            workdir = self.cache.workdir(key)

        def discard() -> None:
            shutil.rmtree(workdir.parent if spec.dry_run else workdir, ignore_errors=True)

        ctx = BuildContext(spec=spec, target=plan.target, workdir=workdir, record=record, log=self.log)
        hook = getattr(self.registry.hook, f"forge_{stage}")
        started = time.perf_counter()
        self.log(f"{plan.component.name}: {stage} …")
        try:
            if stage == "export":
                result = hook(component=plan.component, ctx=ctx)
                if result is None:
                    raise ForgeError(f"no plugin exported component {plan.component.name!r} "
                                     f"(family {plan.component.family!r})")
            else:
                result = hook(component=plan.component, artifact=artifact, ctx=ctx)
        except BaseException:
            discard()
            raise
        record.seconds = round(time.perf_counter() - started, 3)
        if spec.dry_run:
            discard()
            return result or artifact
        if result is None:
            shutil.rmtree(workdir, ignore_errors=True)
            self.cache.mark_passthrough(key)
            stored = artifact
        else:
            result.commands = record.commands
            stored = self.cache.put(key, result, workdir)
            shutil.rmtree(workdir, ignore_errors=True)
        (self.cache.root / key).mkdir(parents=True, exist_ok=True)  # an artifact outside the cache has no entry
        (self.cache.root / key / "record.json").write_text(
            json.dumps({"commands": record.commands, "notes": record.notes}, default=str))
        return stored

    def export(self, spec: BuildSpec) -> list[ComponentPlan]:
        """Run the export stage of every component (and quantize, under ``--quant``); copy the artifacts to ``spec.out``.

        ``--quant`` runs the same quantize stage as ``forge build``, so the exported artifact is the one
        the compile stage would get, never a silently unquantized one.
        """
        stages = ("export", "quantize") if spec.quant else ("export",)
        plans = self.plan(spec, stages=stages)
        for plan in plans:
            artifact = None
            for stage in stages:
                artifact = self._run_stage(stage, plan, spec, artifact)
            plan.artifact = artifact
        if spec.dry_run:
            return plans
        self._publish(spec.out, lambda staging: self._copy_exports(plans, staging))
        return plans

    def _copy_exports(self, plans: list[ComponentPlan], staging: Path) -> dict[str, Any]:
        for plan in plans:
            dst = staging / plan.component.name if len(plans) > 1 else staging
            publish.place(plan.artifact.path, dst if plan.artifact.path.is_dir() else dst / plan.artifact.path.name)
        return self._manifest(plans, [], None)

    def build(self, spec: BuildSpec) -> BuildResult:
        """Build a complete repository (or print the plan under ``--dry-run``)."""
        plans = self.plan(spec)
        build_key = fingerprint([p.keys for p in plans], spec.name_prefix)
        manifest_path = spec.out / publish.MANIFEST
        if not spec.dry_run and manifest_path.is_file():
            try:
                previous = json.loads(manifest_path.read_text())
            except ValueError:
                previous = {}
            if previous.get("build_fingerprint") == build_key:
                self.log(f"{spec.out} is up to date")
                return BuildResult(spec.out, True, plans, previous.get("models", []), previous)
        for plan in plans:
            artifact = None
            for stage in STAGES:
                artifact = self._run_stage(stage, plan, spec, artifact)
            plan.artifact = artifact
        if spec.dry_run:
            return BuildResult(spec.out, False, plans, [], self._manifest(plans, [], build_key))

        models: dict[str, TritonModel] = {}
        for plan in plans:
            record = StageRecord("emit_config", plan.keys["compile"])
            plan.records.append(record)
            ctx = BuildContext(spec=spec, target=plan.target, workdir=plan.artifact.path,
                               record=record, log=self.log)
            emitted = self.registry.hook.forge_emit_config(component=plan.component,
                                                           artifact=plan.artifact, ctx=ctx)
            if not emitted:
                raise ForgeError(f"no plugin emitted Triton models for component {plan.component.name!r}")
            for model in emitted:
                check_name(model.name, "model name")
                if model.name in models:
                    raise ValidationError(f"two components emit a model called {model.name!r}")
                models[model.name] = model
        ctx = BuildContext(spec=spec, target="", workdir=spec.out, record=StageRecord("ensemble", ""), log=self.log)
        edge_lists = self.registry.hook.forge_ensemble_edges(
            components=[p.component for p in plans], models=models, ctx=ctx)
        edges: dict[str, list[Edge]] = {}
        for edge in (e for lst in edge_lists if lst for e in lst):
            edges.setdefault(edge.ensemble, []).append(edge)
        configs = {name: m.config for name, m in models.items()}
        from . import ensemble  # protobuf: only builds write Triton configs

        for name in ensemble.nesting_order(edges):
            check_name(name, "ensemble name")
            if name in models:
                raise ValidationError(f"ensemble name {name!r} clashes with a model of the same name")
            models[name] = TritonModel(ensemble.assemble(name, edges[name], configs))
            configs[name] = models[name].config  # an ensemble may be a step of another one
            self.log(f"ensemble {name}: {len(models[name].config.ensemble_scheduling.step)} steps")
        manifest = self._manifest(plans, sorted(models), build_key)

        def write(staging: Path) -> dict[str, Any]:
            for model in models.values():
                publish.write_model(model, staging)
            from .checks import validate_repository

            problems = validate_repository(staging, located_at=spec.out)
            if problems:
                raise ValidationError(f"built repository failed validation: {problems[0]}")
            return manifest

        self._publish(spec.out, write)
        return BuildResult(spec.out, False, plans, sorted(models), manifest)

    # -- output ---------------------------------------------------------------------------------
    def _publish(self, out: Path, fill: Callable[[Path], dict[str, Any]]) -> None:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a regular file, not a directory")
        if out.is_dir() and any(out.iterdir()) and not publish.is_forge_repo(out):
            raise UsageError(f"--out {out} is a non-empty directory that forge did not write",
                             hint="choose another --out or empty it first")
        out.parent.mkdir(parents=True, exist_ok=True)
        with publish.locked(out, cache_dir() / "locks"):
            publish.clean_stale(out)
            staging = publish.staging_dir(out)
            try:
                manifest = fill(staging)
                (staging / publish.MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
                publish.swap_into_place(staging, out)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise

    def _manifest(self, plans: list[ComponentPlan], models: list[str], build_key: str | None) -> dict[str, Any]:
        built_families = {p.component.family for p in plans}
        return {
            "forge_version": __version__,
            "python": sys.version.split()[0],  # what platform.python_version() reads
            "build_fingerprint": build_key,
            "plugins": {info.name: info.version for info in self.registry.infos.values()
                        if set(info.families) & built_families},
            "toolchain": self._tools,
            "argv": shlex.join(sys.argv),
            "spec": self._spec_json,
            "components": [
                {"name": p.component.name, "family": p.component.family, "role": p.component.role,
                 "target": p.target, "source": str(p.component.source),
                 "artifact": p.artifact.to_json() if p.artifact else None,
                 "stages": [asdict(r) for r in p.records]}
                for p in plans],
            "models": models,
        }
