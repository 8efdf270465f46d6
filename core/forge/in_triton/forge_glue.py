"""The glue every forge python-backend model shares; copied next to each ``model.py`` as ``forge_glue.py``.

It runs inside tritonserver's python stub and imports nothing from forge (numpy and, when present,
``triton_python_backend_utils``), so it is importable without Triton for tests. One home for: model
config parameters, per-request errors, the request loop, and building/sending responses.

Responses carry only the outputs the client asked for. The python backend of tritonserver 2.51
(Triton r24.06–r24.11, what nvidia-pytriton 0.7 bundles) drops unrequested output tensors without
holding the GIL when a response is sent through a response sender; on Python 3.12 that crashes the
stub (python_backend PR #390 fixed it in r24.12). Never handing it an unrequested tensor, and
keeping the tensors referenced until ``send`` returns, avoids the crash on every version.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by the build (parity checks) and tests, outside Triton
    pb_utils = None

#: Files of a Hugging Face checkpoint that make up its tokenizer (and its chat/generation defaults).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "generation_config.json", "chat_template.jinja",
                   "chat_template.json", "config.json")
#: The files of which at least one must exist for a tokenizer to load.
TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                  "vocab.json", "vocab.txt")

TRUE = ("true", "1", "t", "y", "yes", "on")
FALSE = ("false", "0", "f", "n", "no", "off")


def parse_bool(value: Any, default: bool) -> bool:
    """A Triton parameter string (or a bool) as a bool; unset or unknown → ``default``."""
    if isinstance(value, bool):
        return value
    if value is None:
        return default
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    return default


def model_config(args: Mapping[str, Any]) -> dict:
    """The model config Triton passes to ``initialize`` (a json string) as a dict."""
    return json.loads(args["model_config"])


def parameters(config: Mapping[str, Any]) -> dict[str, str]:
    """The ``parameters`` of a Triton model config (a json dict) as plain strings."""
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def error(exc: BaseException, where: str = "") -> Any:
    """A Triton error for ``exc``: INVALID_ARG for bad input (ValueError), INTERNAL otherwise."""
    codes = pb_utils.TritonError
    text = f"{where}: {exc}" if where else str(exc)
    code = getattr(codes, "INVALID_ARG" if isinstance(exc, ValueError) else "INTERNAL", None)
    return codes(text, code) if code is not None else codes(text)


def get(request, name: str, accepted: Iterable[str] | None = None) -> np.ndarray | None:
    """Input ``name`` of ``request`` as numpy (None when absent or not an input of this model)."""
    if accepted is not None and name not in accepted:
        return None
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def requested(request) -> set[str] | None:
    """The output names the client asked for (None: this Triton cannot tell, send every output).

    Read it inside ``execute``: a response sent later from another thread uses the saved set.
    """
    names = getattr(request, "requested_output_names", None)
    if names is None:
        return None
    try:
        return set(names())
    except Exception:  # noqa: BLE001 - an older stub without the call
        return None


_NUMPY2 = int(np.__version__.split(".")[0]) >= 2


def tensor(name: str, value: np.ndarray):
    """A Triton output tensor; under numpy 2 through DLPack (numpy-2 stubs reject numpy-made tensors)."""
    if _NUMPY2 and value.dtype != np.object_:  # text (BYTES) has no DLPack form; pb_utils takes it as numpy
        import torch

        return pb_utils.Tensor.from_dlpack(name, torch.from_numpy(np.ascontiguousarray(value)))
    return pb_utils.Tensor(name, value)


def select(outputs: Mapping[str, np.ndarray] | Iterable[Any], wanted: set[str] | None) -> list:
    """Triton tensors for the outputs in ``wanted`` (None: all); ``pb_utils.Tensor`` items pass through."""
    items = outputs.items() if isinstance(outputs, Mapping) else ((t.name(), t) for t in outputs)
    return [value if not isinstance(value, np.ndarray) else tensor(name, value)
            for name, value in items if wanted is None or name in wanted]


def response(request, outputs: Mapping[str, np.ndarray] | Iterable[Any]):
    """An InferenceResponse of ``request`` holding only the outputs it asked for."""
    return pb_utils.InferenceResponse(output_tensors=select(outputs, requested(request)))


def error_response(exc: BaseException, where: str = ""):
    """An InferenceResponse carrying only ``exc`` as a Triton error."""
    return pb_utils.InferenceResponse(output_tensors=[], error=error(exc, where))


def send(sender, outputs: Mapping[str, np.ndarray] | Iterable[Any] | None = None, *,
         wanted: set[str] | None = None, flags: int = 0, exc: BaseException | None = None,
         where: str = "") -> None:
    """Send one response through ``sender``: the ``wanted`` outputs, ``exc`` as an error, or only ``flags``.

    The tensors stay referenced here until ``send`` returns (see the module docstring).
    """
    kept = [] if outputs is None or exc is not None else select(outputs, wanted)
    if exc is not None:
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error(exc, where)), flags=flags)
    elif outputs is None:
        sender.send(flags=flags)
    else:
        sender.send(pb_utils.InferenceResponse(output_tensors=kept), flags=flags)
    del kept


def stop_request(sender, request_id: str, pending: Callable[[], Iterable[Any]], cancel: Callable[[Any], None],
                 lock) -> None:
    """TensorRT-LLM's ``stop`` input: ``cancel`` each of ``pending()`` (read under ``lock``) whose ``request_id``
    is this request's, then answer the stop request itself (an error when it names no request id)."""
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    if not request_id:
        send(sender, exc=ValueError("a stop request needs the request id of the request to stop"), flags=final)
        return
    with lock:
        victims = [p for p in pending() if p.request_id == request_id]
    for victim in victims:
        cancel(victim)
    send(sender, {}, flags=final)


def run_each(requests, handle: Callable[[Any], Any], where: str = "") -> list:
    """``handle`` each request on its own: one bad request answers with its error, the others still run.

    ``handle`` returns a mapping of output name → array (or a list of ``pb_utils.Tensor``).
    """
    responses = []
    for request in requests:
        try:
            responses.append(response(request, handle(request)))
        except Exception as exc:  # noqa: BLE001 - one bad request must not fail the batch
            responses.append(error_response(exc, where))
    return responses


#: How often the parent-death watch looks (seconds): a stub outlives its server by about this much.
WATCH_INTERVAL = 0.25
_orphan_check = None  # (gone, exit_now) of the running watch


def exit_if_orphaned() -> None:
    """End this process now, as the parent-death watch would, if the server it talks to is gone.

    For code about to talk to the server (a model's ``finalize``, a sender thread): a call into a dead
    server can block, and the watch thread cannot end the process while another thread holds the GIL.
    """
    if _orphan_check is not None:
        gone, exit_now = _orphan_check
        reason = gone()
        if reason is not None:
            exit_now(reason)


#: packages transformers imports that a text model's process never uses (torchvision over a second of each
#: start, scipy a quarter: for vision models and their losses)
VISION_LIBRARIES = ("torchvision", "scipy")


def skip_vision_libraries(checkpoint: str | os.PathLike) -> None:
    """In a model process (tritonserver's python stub) of a checkpoint without images, before transformers is first
    imported: make :data:`VISION_LIBRARIES` read as not installed, to ``import`` and to transformers, so every
    start of the process (and every recovery of a dead one) is that much shorter."""
    if in_stub() and "transformers" not in sys.modules and not _has_vision(str(checkpoint)):
        for unused in VISION_LIBRARIES:
            sys.modules.setdefault(unused, None)


def _has_vision(path: str) -> bool:
    """Whether the checkpoint in ``path`` takes images (a vision tower or image processor beside its tokenizer)."""
    try:
        with open(os.path.join(path, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return True  # unknown: keep every library
    return "vision_config" in config or any(
        os.path.exists(os.path.join(path, name)) for name in ("preprocessor_config.json", "processor_config.json"))


def in_stub() -> bool:
    """Whether this process is a python model process of tritonserver (its python backend's stub)."""
    return bool(_stub_args())


def _stub_args() -> list[str]:
    """This process's arguments when it is tritonserver's python stub (``model.py`` path, shared-memory region,
    …), else []."""
    try:
        args = open("/proc/self/cmdline", "rb").read().split(b"\0")
    except OSError:
        return []
    if len(args) > 2 and os.path.basename(args[0]) == b"triton_python_backend_stub":
        return [arg.decode(errors="replace") for arg in args[1:]]
    return []


def _stub_shm_region() -> str | None:
    """The shared-memory region tritonserver made for this stub (the stub's 2nd argument), if this is a stub."""
    args = _stub_args()
    return args[1] if args else None


def exit_with_parent(also: Iterable[int] = (), interval: float = WATCH_INTERVAL, what: str = "",
                     parent: bool = True) -> threading.Thread | None:
    """End this process (``os._exit``) within ``interval`` once its parent (unless ``parent`` is False) or a pid
    in ``also`` is gone.

    A daemon thread polls ``os.getppid()`` against the parent seen now: the stub's own check of its
    parent runs Python teardown (``finalize``, interpreter exit), which can wait forever on a thread
    blocked in a send to the dead server, leaving a re-parented stub holding its memory.
    ``os._exit`` runs no teardown. The stub's shared-memory region, which the dead server can no longer
    remove, is unlinked first. A parent that is pid 1 (tritonserver as a container's init) is not watched.
    Returns the thread (None when there is nothing to watch).
    """
    parent = os.getppid() if parent else 0
    others = [int(pid) for pid in also if int(pid) > 0]
    if parent <= 1 and not others:
        return None
    region = _stub_shm_region()

    def gone() -> str | None:
        if parent > 1 and os.getppid() != parent:
            return f"its parent (pid {parent}) exited"
        for pid in others:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return f"process {pid} exited"
            except PermissionError:
                pass
        return None

    def exit_now(reason: str) -> None:
        try:
            sys.stderr.write(f"forge: {what or 'model process'} {os.getpid()} exits: {reason}\n")
            sys.stderr.flush()
            if region and "/" not in region:
                os.unlink(f"/dev/shm/{region}")
        except OSError:
            pass
        finally:
            os._exit(1)

    def watch() -> None:
        while True:
            reason = gone()
            if reason is not None:
                exit_now(reason)
            time.sleep(interval)

    global _orphan_check
    _orphan_check = (gone, exit_now)
    _reaper(([parent] if parent > 1 else []) + others, region)
    thread = threading.Thread(target=watch, name="forge-parent-watch", daemon=True)
    thread.start()
    return thread


#: Seconds the reaper gives the watch thread before it kills a process whose watched process is gone.
REAPER_GRACE_S = 2.0


def _reaper(watched: list[int], region: str | None) -> None:
    """A shell loop beside this process that kills it (SIGKILL) when a watched process is gone and it has not
    exited REAPER_GRACE_S later. The watch thread needs the GIL, and a thread blocked in a call into the dead
    server can hold it (seen: every thread of a decoder's process waiting on a futex after its server was
    killed); the shell needs nothing of this process. It ends when this process does."""
    import shlex
    import subprocess

    me = os.getpid()
    alive = " && ".join(f"kill -0 {pid} 2>/dev/null" for pid in watched)
    unlink = f"rm -f {shlex.quote('/dev/shm/' + region)}; " if region and "/" not in region else ""
    # only a process still there after the grace: one the watch thread ended has removed its region itself,
    # and a restarted server may have made a region of the same name since
    script = (f"while kill -0 {me} 2>/dev/null; do if ! {{ {alive}; }}; then sleep {REAPER_GRACE_S}; "
              f"kill -0 {me} 2>/dev/null && {{ {unlink}kill -9 {me}; }}; exit 0; fi; sleep 0.5; done")
    try:
        subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:  # no shell: the watch thread alone
        pass


#: The request id prefix of the requests forge's OpenAI API sends (it fails those itself when a model process dies).
FRONT_REQUEST_PREFIX = "forge-openai:"
#: Where forge serve asks each model process to count the requests only it can answer (see InFlight).
IN_FLIGHT_DIR = "FORGE_INFLIGHT_DIR"


class InFlight:
    """This model process's count of the requests only it can answer, in a file ``forge serve`` reads when it died.

    tritonserver answers a request with an error when the process of the python model executing it dies, but
    not one the model answers through a response sender (every decoupled model, and non-decoupled ones that
    answer from other threads): that request waits forever, and only the end of tritonserver releases it. So
    ``forge serve`` reloads just the dead model when no such request was left in it, and restarts tritonserver
    when one was. A model answering through senders calls ``track()`` in ``initialize``, then ``opened`` for each
    request it takes and ``closed`` with what it returned once the final response is sent. Requests forge's own
    OpenAI API sent are not counted: it fails them itself. The file (``$FORGE_INFLIGHT_DIR/<model>/<pid>``)
    holds two little-endian int64: 1 once tracked, and the count. Without the directory nothing is written.
    """

    def __init__(self, path: str | None = None):
        self._lock = threading.Lock()
        self._map = None
        self.count = 0
        if path is None:
            return
        import mmap

        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w+b") as handle:
                handle.write(bytes(16))
                handle.flush()
                self._map = mmap.mmap(handle.fileno(), 16)
        except (OSError, ValueError):  # nowhere to count: forge serve then restarts tritonserver on a death
            self._map = None

    @staticmethod
    def path(directory: str, model: str, pid: int) -> str:
        """Where the process ``pid`` of ``model`` keeps its count under ``directory`` ($FORGE_INFLIGHT_DIR)."""
        return os.path.join(directory, model, str(pid))

    @staticmethod
    def read(path) -> int | None:
        """The count a model process left in ``path``; None when it never tracked (or the file is not one)."""
        try:
            data = open(path, "rb").read()
        except OSError:
            return None
        if len(data) < 16 or not int.from_bytes(data[:8], "little"):
            return None
        return max(int.from_bytes(data[8:16], "little", signed=True), 0)

    def track(self) -> None:
        if self._map is not None:
            self._map[0:8] = (1).to_bytes(8, "little")

    def opened(self, request_id: str) -> bool:
        """Count a request taken (not one of the OpenAI API's); what to pass to ``closed``."""
        if request_id.startswith(FRONT_REQUEST_PREFIX):
            return False
        self._add(1)
        return True

    def closed(self, counted: bool) -> None:
        if counted:
            self._add(-1)

    def _add(self, delta: int) -> None:
        with self._lock:
            self.count += delta
            if self._map is not None:
                self._map[8:16] = self.count.to_bytes(8, "little", signed=True)


def _in_flight() -> InFlight:
    """The process's InFlight: counted in a file when this is a python stub forge serve started."""
    directory, args = os.environ.get(IN_FLIGHT_DIR), _stub_args()
    if not directory or not args:
        return InFlight()
    model = os.path.basename(os.path.dirname(os.path.dirname(args[0])))  # <repo>/<model>/<version>/model.py
    return InFlight(InFlight.path(directory, model, os.getpid()))


in_flight = _in_flight()

if pb_utils is not None and _stub_args():  # inside tritonserver's python stub (its engine process watches its own)
    exit_with_parent(what="python model process")
