"""vLLM's statistics as Triton metrics, for a model whose config sets ``REPORT_CUSTOM_METRICS`` to ``"true"``.

The names, kinds and buckets are those Triton's vLLM backend reports (``vllm:prompt_tokens_total``,
``vllm:time_to_first_token_seconds`` …, labels ``model`` and ``version``), plus the scheduler's gauges under the
names vLLM's own server uses (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``). The engine process sends one ``stats`` message per engine step
(:func:`forge_vllm_engine.stats_message`); :meth:`VllmMetrics.record` adds those that came meanwhile to the
metrics tritonserver serves on its metrics port, with as few calls as they allow: each is a round trip to
tritonserver, and fewer leave the engine's CPU alone.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

REPORT = "REPORT_CUSTOM_METRICS"
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
N_BUCKETS = [1, 2, 5, 10, 20]


def enabled(config: dict) -> bool:
    """Whether the model's config asks for the metrics (the vLLM backend's parameter)."""
    value = config.get("parameters", {}).get(REPORT, {}).get("string_value", "")
    return value.strip().lower() == "true"


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50 … up to ``limit`` (vLLM's buckets of token counts)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > limit:
                return buckets
            buckets.append(value)
        exponent += 1


class VllmMetrics:
    """The metric families of one model instance."""

    def __init__(self, model: str, version: str, max_model_len: int):
        labels = {"model": model, "version": version}
        self.last: dict[str, float] = {}  # each gauge's value as last set (an unchanged one is not set again)
        self.families = []  # a family outlives its metrics (Triton refuses a metric whose family is gone)

        def family(name: str, description: str, kind, buckets: list | None = None):
            self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            made = self.families[-1]
            return made.Metric(labels=labels, buckets=buckets) if buckets is not None else made.Metric(labels=labels)

        counter, gauge, histogram = (pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE,
                                     pb_utils.MetricFamily.HISTOGRAM)
        tokens = one_two_five(max_model_len)
        self.counters = {
            "prompt_tokens": family("vllm:prompt_tokens_total", "Number of prefill tokens processed.", counter),
            "generation_tokens": family("vllm:generation_tokens_total", "Number of generation tokens processed.",
                                        counter)}
        self.histograms = {
            "ttft": family("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           histogram, TTFT_BUCKETS),
            "tpot": family("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                           histogram, TPOT_BUCKETS),
            "e2e": family("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                          histogram, E2E_BUCKETS),
            "request_prompt_tokens": family("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                            histogram, tokens),
            "request_generation_tokens": family("vllm:request_generation_tokens",
                                                "Number of generation tokens processed.", histogram, tokens),
            "n": family("vllm:request_params_n", "Histogram of the n request parameter.", histogram, N_BUCKETS)}
        self.gauges = {
            "running": family("vllm:num_requests_running", "Number of requests in model execution batches.", gauge),
            "waiting": family("vllm:num_requests_waiting", "Number of requests waiting to be processed.", gauge),
            "kv_cache_usage": family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                     gauge)}

    def record(self, messages: list[dict]) -> None:
        """Some engine steps' ``stats`` messages: each counter incremented once by their sum, every histogram
        value observed, each gauge set to its last value where that changed (each call is a round trip to
        tritonserver)."""
        for key, metric in self.counters.items():
            total = sum(message.get(key) or 0 for message in messages)
            if total:
                metric.increment(float(total))
        for key, metric in self.histograms.items():
            for message in messages:
                for value in message.get(key, ()):
                    metric.observe(float(value))
        for key, metric in self.gauges.items():
            values = [message[key] for message in messages if key in message]
            if values and values[-1] != self.last.get(key):
                metric.set(float(values[-1]))
                self.last[key] = values[-1]
