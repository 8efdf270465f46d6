"""The Prometheus metrics of the OpenAI front (``GET /metrics``): vLLM's names and bucket boundaries for what
the front sees of each generation, the served models' requests waiting and running as tritonserver's metrics
tell them (``scheduler_stats``), and forge's own count of HTTP requests by route and status.

Each front has a registry of its own (several fronts may run in one process). What a generation costs here:
a clock read per response from tritonserver and a handful of counter and histogram updates when it ends.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .scheduler_stats import CACHE_S, Figures

#: vLLM's boundaries (vllm/v1/metrics/buckets.py), so dashboards and alerts written for vLLM read these as they are
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
#: vLLM's ``finished_reason`` values (its FinishReason), each exposed from the start
FINISHED_REASONS = ("stop", "length", "abort")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The metrics of one front, labelled with the served model id as vLLM labels them (``model_name``)."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry(auto_describe=False)
        model = ["model_name"]
        self.generations = 0  # the front's own count: generations sent to tritonserver and not finished yet
        self.scheduled = Figures()  # tritonserver's figures for the served models, as of the last scrape
        self.running = Gauge(
            "vllm:num_requests_running", "Requests decoding: the sequences the served model's forge decoder "
            "(--target python) has in its decoding batch, every client's, from tritonserver's forge_decoder_sequences "
            "less forge_decoder_waiting; for other targets the generations this front sent to tritonserver and not "
            "finished yet.", model, registry=registry).labels(model_name)
        self.running.set_function(self._running)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting, every client's: those tritonserver queues for the served "
            "model and its ensemble steps (nv_inference_pending_request_count) plus the sequences its forge decoder "
            f"queued and not admitted to a decoding batch yet (forge_decoder_waiting); read at most {CACHE_S:g} s "
            "before the scrape.", model, registry=registry).labels(model_name)
        self.waiting.set_function(lambda: self.scheduled.waiting)
        self.read_errors = Counter(
            "forge_openai_metrics_read_errors", "Reads of tritonserver's metrics endpoint that failed or timed out "
            "(vllm:num_requests_waiting and vllm:num_requests_running kept their values).", registry=registry)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed (the prompt tokens of finished generations, "
            "as their usage counts them).", model, registry=registry).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed (the completion tokens of finished "
            "generations, as their usage counts them).", model, registry=registry).labels(model_name)
        success = Counter("vllm:request_success", "Count of successfully processed requests (one per generation: "
                          "a completion request with several prompts counts each).", model + ["finished_reason"],
                          registry=registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds (streamed generations: "
            "from the request sent to tritonserver to its first response).", model,
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS, registry=registry).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds (streamed generations: "
            "the time between two responses of tritonserver).", model, buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=registry).labels(model_name)
        self.time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds (as vLLM's v1, the "
            "same observations as vllm:inter_token_latency_seconds).", model, buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=registry).labels(model_name)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds (from the request sent "
            "to tritonserver to its last response, or to its abort).", model, buckets=REQUEST_LATENCY_BUCKETS,
            registry=registry).labels(model_name)
        self.requests = Counter("forge_openai_requests", "HTTP requests answered by the OpenAI front, by route "
                                "(its path template; 'unmatched' for requests answered before routing) and status.",
                                ["route", "status"], registry=registry)

    def _running(self) -> float:
        running = self.scheduled.running
        return self.generations if running is None else running

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric of this front."""
        return generate_latest(self.registry)

    def clock(self, streamed: bool) -> "Clock":
        """The clock of one generation starting now."""
        return Clock(self, streamed)


class Clock:
    """One generation's timing: started when its request goes to tritonserver, ended once (finished or aborted)."""

    __slots__ = ("metrics", "streamed", "start", "last")

    def __init__(self, metrics: Metrics, streamed: bool):
        self.metrics = metrics
        self.streamed = streamed
        self.start = time.perf_counter()
        self.last: float | None = None
        metrics.generations += 1

    def response(self) -> None:
        """A response of tritonserver arrived (streamed: the first gives the time to first token)."""
        if not self.streamed:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.time_to_first_token.observe(now - self.start)
        else:
            gap = now - self.last
            self.metrics.inter_token_latency.observe(gap)
            self.metrics.time_per_output_token.observe(gap)
        self.last = now

    def finished(self, reason: str, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """The generation ended with ``reason`` (``stop``, ``length``) and these counts (``None``: unknown)."""
        metrics = self.metrics
        metrics.generations -= 1
        metrics.e2e_latency.observe(time.perf_counter() - self.start)
        metrics.success[reason].inc()
        if prompt_tokens:
            metrics.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            metrics.generation_tokens.inc(completion_tokens)

    def aborted(self) -> None:
        """The client went away before the end (vLLM's ``abort``)."""
        self.metrics.generations -= 1
        self.metrics.e2e_latency.observe(time.perf_counter() - self.start)
        self.metrics.success["abort"].inc()

    def failed(self) -> None:
        """The generation ended in an error: no longer running, counted nowhere else."""
        self.metrics.generations -= 1


class Counted:
    """ASGI middleware: counts every HTTP request by its route's path template and its status
    (``forge_openai_requests_total``)."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # an exception that escapes every handler

        async def sent(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # FastAPI puts the matched route in the scope
            self.metrics.requests.labels(route, str(status)).inc()
