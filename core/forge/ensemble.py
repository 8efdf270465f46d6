"""Ensemble graphs: assemble edges into ``ensemble_scheduling`` and check any ensemble config."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping


from . import tritonconfig as tc
from .tritonconfig import mc
from .components import Edge, Port
from .errors import ValidationError


@dataclass(frozen=True)
class TensorInfo:
    dtype: int
    shape: tuple[int, ...]  # full shape, batch dimension (-1) first when the model batches
    optional: bool = False

    def describe(self) -> str:
        return f"{tc.dtype_name(self.dtype)} {list(self.shape)}"


def _shape(config: mc.ModelConfig, dims: Iterable[int]) -> tuple[int, ...]:
    return ((-1,) if config.max_batch_size > 0 else ()) + tuple(dims)


def inputs_of(config: mc.ModelConfig) -> dict[str, TensorInfo]:
    return {t.name: TensorInfo(t.data_type, _shape(config, t.dims), t.optional) for t in config.input}


def outputs_of(config: mc.ModelConfig) -> dict[str, TensorInfo]:
    return {t.name: TensorInfo(t.data_type, _shape(config, t.dims)) for t in config.output}


def shapes_compatible(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def assemble(name: str, edges: list[Edge], models: Mapping[str, mc.ModelConfig]) -> mc.ModelConfig:
    """Build the ensemble model config for ``edges``; unknown models or tensors raise at once."""
    for edge in edges:
        for port, kind in ((edge.src, "output"), (edge.dst, "input")):
            if port.model is None:
                continue
            if port.model not in models:
                raise ValidationError(f"ensemble {name!r}: edge {edge.src} → {edge.dst} names model "
                                      f"{port.model!r}, which the build does not contain")
            tensors = inputs_of(models[port.model]) if kind == "input" else outputs_of(models[port.model])
            if port.tensor not in tensors:
                raise ValidationError(
                    f"ensemble {name!r}: edge {edge.src} → {edge.dst}: {port.model!r} has no {kind} "
                    f"{port.tensor!r} (its {kind}s: {', '.join(sorted(tensors)) or 'none'})")

    members = sorted({p.model for e in edges for p in (e.src, e.dst) if p.model is not None})
    batch = min((models[m].max_batch_size for m in members), default=0)

    # One ensemble tensor per producing port. An output that is also an ensemble output takes the
    # ensemble output's name (Triton maps each model output to exactly one tensor).
    tensor_of: dict[Port, str] = {}
    for edge in edges:
        if edge.dst.model is None:
            if edge.src in tensor_of and tensor_of[edge.src] != edge.dst.tensor:
                raise ValidationError(f"ensemble {name!r}: {edge.src} feeds two ensemble outputs")
            tensor_of[edge.src] = edge.dst.tensor
    intermediate_names = defaultdict(list)
    for edge in edges:
        if edge.src.model is None:
            tensor_of.setdefault(edge.src, edge.src.tensor)
        elif edge.src not in tensor_of:
            intermediate_names[edge.src.tensor].append(edge.src)
    for tensor, ports in intermediate_names.items():
        for port in dict.fromkeys(ports):
            tensor_of[port] = f"_{tensor}" if len(set(ports)) == 1 else f"_{port.model}_{tensor}"

    config = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=batch)
    fed: dict[Port, Edge] = {}
    declared_inputs: dict[str, mc.ModelInput] = {}
    for edge in edges:
        if edge.dst.model is not None:
            if edge.dst in fed:
                raise ValidationError(f"ensemble {name!r}: {edge.dst} is fed twice "
                                      f"(by {fed[edge.dst].src} and by {edge.src})")
            fed[edge.dst] = edge
        if edge.src.model is None and edge.dst.model is not None:
            info = inputs_of(models[edge.dst.model])[edge.dst.tensor]
            dims = info.shape[1:] if batch > 0 else info.shape
            existing = declared_inputs.get(edge.src.tensor)
            if existing is None:
                member_input = next(t for t in models[edge.dst.model].input if t.name == edge.dst.tensor)
                declared_inputs[edge.src.tensor] = tc.model_input(
                    edge.src.tensor, info.dtype, dims, optional=info.optional,
                    allow_ragged_batch=member_input.allow_ragged_batch)
            elif not info.optional:
                existing.optional = False
    config.input.extend(declared_inputs.values())
    seen_outputs = set()
    for edge in edges:
        if edge.dst.model is None and edge.dst.tensor not in seen_outputs:
            seen_outputs.add(edge.dst.tensor)
            info = outputs_of(models[edge.src.model])[edge.src.tensor]
            config.output.append(tc.model_output(edge.dst.tensor, info.dtype,
                                                 info.shape[1:] if batch > 0 else info.shape))

    steps: dict[str, mc.ModelEnsembling.Step] = {}
    for member in _topological(name, members, edges):
        steps[member] = config.ensemble_scheduling.step.add(model_name=member, model_version=-1)
    for edge in edges:
        tensor = tensor_of[edge.src]
        if edge.dst.model is not None:
            steps[edge.dst.model].input_map[edge.dst.tensor] = tensor
        if edge.src.model is not None:
            steps[edge.src.model].output_map[edge.src.tensor] = tensor
    problems = check(config, models)
    if problems:
        raise ValidationError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return config


def nesting_order(groups: Mapping[str, list[Edge]]) -> list[str]:
    """Ensemble names ordered so that an ensemble used as a step of another one is assembled first."""
    uses = {name: {p.model for e in edges for p in (e.src, e.dst) if p.model in groups and p.model != name}
            for name, edges in groups.items()}
    order: list[str] = []
    while uses:
        ready = [n for n, inner in uses.items() if not inner - set(order)]
        if not ready:
            raise ValidationError(f"ensembles {', '.join(sorted(uses))} use each other in a cycle")
        order.extend(ready)
        for n in ready:
            del uses[n]
    return order


def _topological(name: str, members: list[str], edges: list[Edge]) -> list[str]:
    deps = {m: {e.src.model for e in edges if e.dst.model == m and e.src.model} for m in members}
    order: list[str] = []
    while deps:
        ready = sorted(m for m, d in deps.items() if not d - set(order))
        if not ready:
            raise ValidationError(f"ensemble {name!r} has a cycle through {', '.join(sorted(deps))}")
        order.extend(ready)
        for m in ready:
            del deps[m]
    return order


def check(config: mc.ModelConfig, models: Mapping[str, mc.ModelConfig]) -> list[str]:
    """Problems of an ensemble config against its members' configs (empty when consistent)."""
    name = config.name
    problems: list[str] = []
    producers: dict[str, tuple[str, TensorInfo]] = {}
    batch = config.max_batch_size
    for t in config.input:
        producers[t.name] = (f"{name}.input {t.name}", TensorInfo(t.data_type, _shape(config, t.dims)))
    consumers: list[tuple[str, str, str, TensorInfo]] = []  # (tensor, where, model, info)
    graph: dict[int, set[int]] = defaultdict(set)
    producer_step: dict[str, int] = {}
    steps = list(config.ensemble_scheduling.step)
    if not steps:
        problems.append(f"ensemble {name!r} has no ensemble_scheduling steps")
    for index, step in enumerate(steps):
        member = models.get(step.model_name)
        if member is None:
            problems.append(f"ensemble {name!r} step {index} uses model {step.model_name!r}, "
                            "which is not in the repository")
            continue
        ins, outs = inputs_of(member), outputs_of(member)
        if batch > 0 and member.max_batch_size == 0:
            problems.append(f"ensemble {name!r} batches (max_batch_size {batch}) but member "
                            f"{step.model_name!r} does not (max_batch_size 0)")
        for key, tensor in step.output_map.items():
            if key not in outs:
                problems.append(f"ensemble {name!r}: {step.model_name!r} has no output {key!r} "
                                f"(mapped to {tensor!r}); its outputs: {', '.join(sorted(outs))}")
                continue
            if tensor in producers:
                problems.append(f"ensemble {name!r}: tensor {tensor!r} is produced twice "
                                f"({producers[tensor][0]} and {step.model_name}.{key})")
            producers[tensor] = (f"{step.model_name}.{key}", outs[key])
            producer_step[tensor] = index
        for key, tensor in step.input_map.items():
            if key not in ins:
                problems.append(f"ensemble {name!r}: {step.model_name!r} has no input {key!r} "
                                f"(fed from {tensor!r}); its inputs: {', '.join(sorted(ins))}")
                continue
            consumers.append((tensor, f"{step.model_name}.{key}", step.model_name, ins[key]))
        for key, info in ins.items():
            if not info.optional and key not in step.input_map:
                problems.append(f"ensemble {name!r}: required input {step.model_name}.{key} is not fed")
    for t in config.output:
        consumers.append((t.name, f"{name}.output {t.name}", "", TensorInfo(t.data_type, _shape(config, t.dims))))

    step_index = {s.model_name: i for i, s in enumerate(steps)}
    for tensor, where, model, info in consumers:
        if tensor not in producers:
            problems.append(f"ensemble {name!r}: {where} reads tensor {tensor!r}, which no step "
                            "produces and is not an ensemble input")
            continue
        source, produced = producers[tensor]
        if produced.dtype != info.dtype:
            problems.append(f"ensemble {name!r}: dtype mismatch {source} ({produced.describe()}) → "
                            f"{where} ({info.describe()})")
        elif not shapes_compatible(produced.shape, info.shape):
            problems.append(f"ensemble {name!r}: dims mismatch {source} ({produced.describe()}) → "
                            f"{where} ({info.describe()})")
        if model and tensor in producer_step:
            graph[producer_step[tensor]].add(step_index[model])
    if _has_cycle(graph, len(steps)):
        problems.append(f"ensemble {name!r}: its steps form a cycle")
    else:
        problems += _decoupled_origins(name, steps, models)
    return problems


def _decoupled_origins(name: str, steps: list, models: Mapping[str, mc.ModelConfig]) -> list[str]:
    """Triton refuses a step whose inputs come from different decoupled sources.

    A tensor's origin is the nearest decoupled model upstream of it, or the ensemble request itself.
    Responses of a decoupled model cannot be matched with tensors of another origin, so the server
    fails to load such an ensemble ("inputs originated from different decoupled models").
    """
    origin: dict[str, str] = {}
    pending = [s for s in steps if s.model_name in models]
    problems: list[str] = []
    produced = {t for s in pending for t in s.output_map.values()}
    while pending:
        ready = [s for s in pending if all(t in origin or t not in produced for t in s.input_map.values())]
        if not ready:
            break
        for step in ready:
            pending.remove(step)
            sources = {origin.get(t, "the ensemble request") for t in step.input_map.values()}
            if len(sources) > 1:
                problems.append(f"ensemble {name!r}: step {step.model_name!r} mixes tensors from different "
                                f"decoupled sources ({', '.join(sorted(sources))}); Triton will not load it")
            member = models[step.model_name]
            own = (f"decoupled model {step.model_name!r}" if member.model_transaction_policy.decoupled
                   else next(iter(sorted(sources)), "the ensemble request"))
            for tensor in step.output_map.values():
                origin[tensor] = own
    return problems


def _has_cycle(graph: Mapping[int, set[int]], n: int) -> bool:
    state = [0] * n  # 0 new, 1 on stack, 2 done

    def visit(node: int) -> bool:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state[nxt] == 1 or (state[nxt] == 0 and visit(nxt)):
                return True
        state[node] = 2
        return False

    return any(state[i] == 0 and visit(i) for i in range(n))
