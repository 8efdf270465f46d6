"""Bring back one model whose process died, leaving the repository's other models serving.

tritonserver 2.51 answers the requests a dead python model process held with an error ("Stub process ...
is not healthy"), except those the model answers through a response sender (every decoupled model): they
stay pending until tritonserver itself ends. Loading the model again through the model-control API
(tritonserver runs with ``--model-control-mode=explicit``) starts a new process for it while the other
models serve. So :func:`stranded` reads how many requests the dead process left that way (the count
forge_glue.InFlight keeps in each model process), and ``forge serve`` (:mod:`.session`) reloads the model
alone (:func:`reload`) when that is 0, and restarts tritonserver otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ForgeError
from ..in_triton.forge_glue import InFlight
from .processes import how_it_ended, proc_stat
from .triton_server import TritonServer, _first_line


def reload(server: TritonServer, model: str, held: bool = False) -> None:
    """Load ``model`` again (a new process for it) while the other models serve; ForgeError when it fails.

    tritonserver takes a load request for a loaded model whose files did not change as done, even when its
    process is dead (until a request found it so): the model is unloaded first, which returns at once (an old
    process that lives ends once it answered what it held). ``held``: the dead process held requests (the
    OpenAI API's, which it answered itself); a decoupled model's old generation then never unloads, nor does the
    old generation of an ensemble with the model (decoupled or not) as a step, which ``server.held`` counts for
    its stop (:class:`Held`).

    Through gRPC: tritonserver answers a model-control request on the thread that took it, and an HTTP one
    blocks one of its HTTP threads for the whole load, holding up the streams of the other models' HTTP
    clients that share it (12 s for a 12 s load; on a GPU some never finished). Its gRPC control thread is
    its own: inference and health over gRPC and HTTP go on meanwhile.
    """
    from tritonclient.grpc import InferenceServerClient
    from tritonclient.utils import InferenceServerException

    try:
        with InferenceServerClient(server.grpc_url) as control:
            control.unload_model(model, client_timeout=30)
            control.load_model(model, client_timeout=server.startup_timeout)
    except InferenceServerException as exc:
        reason = _first_line(exc.message() or "") or str(exc.status() or "no answer")
        raise ForgeError(f"could not load model {model!r} again: {reason}") from None
    if not held:
        return
    configs = _configs(server)
    own = decoupled(configs, model) is not False  # tritonserver answers a plain model's requests itself
    ensembles = ensembles_of(configs, model)
    if own or ensembles:
        if server.held is None:
            server.held = Held(others={m["name"] for m in server.models()})
        server.held.add(model, ensembles, own=own)


class Held:
    """The model generations a running tritonserver never unloads: each dead process's generation of a decoupled
    model loaded again while it held requests (the OpenAI API's, answered by the API itself), the generation of
    each ensemble with that model (decoupled or not) as a step (loaded again with it; its requests stay), and the
    ensembles' other steps, which those requests keep loaded. At a stop, tritonserver logs each second how many
    models it still waits for: when every other model has unloaded and only these are left, it can be ended."""

    def __init__(self, others: set[str]):
        self.generations = 0
        self.names: set[str] = set()  # models and ensembles with a held generation
        self.steps: set[str] = set()  # models held loaded by those ensembles' requests
        self.others = others  # every model of the server

    def add(self, model: str, ensembles: dict[str, list[str]], own: bool = True) -> None:
        """``model`` was loaded again while its dead process held requests; ``own``: its dead generation is held
        too (a decoupled model's), else only the generations of its ``ensembles`` (a plain step's requests get
        tritonserver's error, while the ensemble requests around them stay)."""
        self.generations += int(own) + len(ensembles)
        self.names |= {*([model] if own else []), *ensembles}
        # a plain step's new generation is among the steps those ensemble requests keep loaded
        self.steps |= {step for steps in ensembles.values() for step in steps} - ({model} if own else set())

    def only_left(self, log: str) -> bool:
        """Whether the stopping server's log (from its start) says it waits for these alone."""
        live = _LIVE.findall(log[-4000:])
        if not live or live[-1][1] != "0" or int(live[-1][0]) > self.generations + len(self.steps):
            return False
        unloaded = set(_UNLOADED.findall(log))
        return not (self.others - self.names - self.steps - unloaded)


_LIVE = re.compile(r"Found (\d+) live models and (\d+) in-flight non-inference requests")
_UNLOADED = re.compile(r"successfully unloaded '([^']+)' version")


def _configs(server: TritonServer) -> dict:
    """The repository's model configs by name ({} when unreadable)."""
    from ..checks import load_configs

    try:
        return load_configs(Path(server.repo))[0]
    except Exception:  # noqa: BLE001 - unreadable configs: none known
        return {}


def ensembles_of(configs: dict, model: str) -> dict[str, list[str]]:
    """The ensembles among ``configs`` with ``model`` as a step: name → every step's model."""
    found = {}
    for name, config in configs.items():
        steps = [step.model_name for step in config.ensemble_scheduling.step]
        if model in steps:
            found[name] = steps
    return found


def decoupled(configs: dict, model: str) -> bool | None:
    """Whether ``model`` answers through response senders (None: no config of it)."""
    config = configs.get(model)
    return None if config is None else config.model_transaction_policy.decoupled


def restart_reason(server: TritonServer, deaths: list[tuple[int, str]], engine_deaths: set[int]) -> str | None:
    """Why only a restart of tritonserver brings back the models of ``deaths`` ((pid, model); pid 0: a death
    counted, not seen; ``engine_deaths``: the pids that were engine processes); None: reloading them alone will."""
    if server.world is not None and server.world.world_size > 1:
        return "its ranks run in other processes"
    # a dead engine process's model process lives on and has answered its requests with the error
    stubs: dict[str, list[int]] = {}
    for pid, model in deaths:
        if pid not in engine_deaths:
            stubs.setdefault(model, []).append(pid)
    held, unknown = 0, []
    for model, pids in stubs.items():
        count = stranded(server, model, pids)
        if count is None:
            unknown.append(model)
        held += count or 0
    if held:
        return f"{held} request(s) from clients other than the OpenAI API were waiting in it, and only a restart " \
               "answers them"
    if unknown:
        return f"model {unknown[0]!r} answers through response senders without counting its requests"
    return None


def stranded(server: TritonServer, model: str, pids: list[int]) -> int | None:
    """How many requests the dead processes ``pids`` of ``model`` held that tritonserver will never answer (the
    counts forge_glue.InFlight kept): 0 when they answered none through a response sender, or only the OpenAI
    API's (which fails them itself); None when unknown (a decoupled model that kept no count, or a death whose
    pid was not seen). The counts of processes no longer running are removed."""
    counts = []
    for path in (Path(server.in_flight_dir or "/nonexistent") / model).glob("*"):
        pid = int(path.name) if path.name.isdigit() else 0
        if pid not in pids and proc_stat(pid) is not None and how_it_ended(pid) is None:
            continue  # a living process of the model (another instance)
        if pid in pids:
            counts.append(InFlight.read(path))
        path.unlink(missing_ok=True)
    if any(counts) or (len(counts) == len(pids) and None not in counts):
        return sum(count or 0 for count in counts)
    # kept no count: a model answering by returning its responses (tritonserver answers them), unless it is
    # decoupled (it answers through senders)
    return 0 if decoupled(_configs(server), model) is False else None
