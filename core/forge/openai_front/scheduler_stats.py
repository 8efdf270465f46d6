"""What the served models hold, in vLLM's terms (requests waiting, requests running), read from tritonserver's
metrics endpoint when the front's ``/metrics`` is scraped.

Waiting: the requests tritonserver queues for the served model and its ensemble steps
(``nv_inference_pending_request_count``) plus the sequences a forge decoder (the python target) queued and has not
admitted to its decoding batch yet (``forge_decoder_waiting``). Running: the sequences forge decoders are decoding
(``forge_decoder_sequences`` less ``forge_decoder_waiting``). A model of forge's ``vllm`` backend reports vLLM's
own scheduler (``vllm:num_requests_waiting``, ``vllm:num_requests_running``), which count too. Running is unknown
where neither serves the models. Every client's requests count, not only the front's, as vLLM counts them.

A read waits at most about READ_TIMEOUT_S and serves the scrapes of the next CACHE_S. One that fails leaves the
figures as they were and is counted: a scrape never fails for it.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.request
from typing import Callable, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

PENDING = "nv_inference_pending_request_count"
DECODER_WAITING = "forge_decoder_waiting"
DECODER_SEQUENCES = "forge_decoder_sequences"
VLLM_WAITING, VLLM_RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"  # forge's vllm backend
READ_TIMEOUT_S = 2.0  # well inside Prometheus's default scrape timeout (10 s)
CACHE_S = 1.0  # several scrapers (Prometheus replicas, KEDA, a dashboard) cost one read of tritonserver a second

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # tritonserver is local: never a proxy


class Figures(NamedTuple):
    """The served models' requests waiting, and running (None: no forge decoder says)."""

    waiting: float = 0.0
    running: float | None = None


def figures(text: str, models: set[str] | None) -> Figures:
    """The figures of ``models`` (None: every model) in tritonserver's metrics text (Prometheus exposition)."""
    names = (PENDING, DECODER_WAITING, DECODER_SEQUENCES, VLLM_WAITING, VLLM_RUNNING)
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(names)) + "\n"
    sums = dict.fromkeys(names, 0.0)
    seen = set()
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            if sample.name in sums and (models is None or sample.labels.get("model") in models):
                sums[sample.name] += sample.value
                seen.add(sample.name)
    running = None
    if DECODER_SEQUENCES in seen:
        running = max(0.0, sums[DECODER_SEQUENCES] - sums[DECODER_WAITING])
    if VLLM_RUNNING in seen:
        running = (running or 0.0) + sums[VLLM_RUNNING]
    return Figures(sums[PENDING] + sums[DECODER_WAITING] + sums[VLLM_WAITING], running)


class SchedulerStats:
    """The last figures read from ``metrics_url`` (None: nothing to read) for ``models``."""

    def __init__(self, metrics_url: str | None, models: list[str], on_error: Callable[[], None]):
        self.metrics_url = metrics_url
        self.models = set(models)
        self.on_error = on_error
        self.last = Figures()
        self.read_at = -math.inf
        self.lock = threading.Lock()  # one read at a time; a scrape meanwhile takes its figures

    def refresh(self) -> Figures:
        """The figures, read again when older than CACHE_S (blocking: call it from a worker thread)."""
        if self.metrics_url is None:
            return self.last
        with self.lock:
            if time.monotonic() - self.read_at >= CACHE_S:
                try:
                    self.last = figures(self._read(), self.models)
                except Exception:  # noqa: BLE001 - unreachable, slow or malformed: the last figures stand
                    self.on_error()
                self.read_at = time.monotonic()
        return self.last

    def _read(self) -> str:
        deadline = time.monotonic() + READ_TIMEOUT_S
        chunks = []
        with _DIRECT.open(self.metrics_url, timeout=READ_TIMEOUT_S) as response:
            while chunk := response.read(1 << 16):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.metrics_url} answered for more than {READ_TIMEOUT_S:g} s")
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
