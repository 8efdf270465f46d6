"""What every route of the OpenAI API shares: the catalog, the Triton client, the API key, the requests in flight,
the metrics."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from ..errors import UsageError
from ..clients.lora_requests import LoraRequests, ServedAdapter
from .vllm_interface import is_vllm
from .catalog import Catalog, TextModel
from .metrics import Metrics
from .protocol import APIError
from .scheduler_stats import SchedulerStats
from .upstream import Triton


class Front:
    """State shared by the routes: the catalog, the Triton client, the adapters already sent."""

    def __init__(self, catalog: Catalog, grpc_url: str, api_key: str | None = None, metrics_url: str | None = None):
        self.catalog = catalog
        self.grpc_url = grpc_url
        self.api_key = api_key
        self.triton: Triton | None = None
        self.loop = None  # the event loop serving the routes (set at start-up)
        self.draining = False  # forge serve is stopping: new API requests get 503, those in flight go on
        self.in_flight = 0  # API requests whose response (a stream: its last event) is not sent yet
        self.idle = threading.Event()
        self.idle.set()
        self.metrics = Metrics(catalog.model_id)  # this front's own registry: several fronts may share a process
        # tritonserver's metrics endpoint (None: unknown, and no requests read as waiting)
        self.stats = SchedulerStats(metrics_url, self.models_behind(), self.metrics.read_errors.inc)

    async def exposition(self) -> bytes:
        """The ``/metrics`` text, the served models' requests waiting and running read from tritonserver first."""
        if self.stats.metrics_url is not None:
            self.metrics.scheduled = await asyncio.to_thread(self.stats.refresh)
        return self.metrics.exposition()

    def models_behind(self) -> list[str]:
        names = []
        for model in (self.catalog.generator, self.catalog.embedder):
            if model is not None:
                names += [model.name, *model.inputs.steps]
        return sorted(set(names))

    def resolve(self, model_id: str, *, param: str = "model") -> ServedAdapter | None:
        if model_id == self.catalog.model_id:
            return None
        if model_id in self.catalog.adapters:
            return self.catalog.adapters[model_id]
        raise APIError(404, f"the model {model_id!r} does not exist; this server has: "
                            f"{', '.join(self.catalog.ids())}", param=param, code="model_not_found")

    def generator(self) -> TextModel:
        if self.catalog.generator is None:
            raise APIError(400, f"model {self.catalog.model_id!r} generates no text (it is an embedding model); "
                                "use /v1/embeddings", param="model", code="wrong_endpoint")
        return self.catalog.generator

    def lora_tensors(self, adapter: ServedAdapter | None, with_weights: bool) -> dict[str, np.ndarray]:
        """The adapter's tensors, as tensorrtllm_backend's cache protocol sends them (serving.lora)."""
        if adapter is None or is_vllm(self.generator().inputs):
            return {}  # a vLLM-backend model takes the adapter's name in sampling_parameters (with_adapter)
        try:
            return LoraRequests(self.generator().inputs).tensors(adapter, with_weights)
        except UsageError as exc:
            raise APIError(400, str(exc), param="model") from None
