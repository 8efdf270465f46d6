"""``vllm:num_requests_waiting`` and ``vllm:num_requests_running`` of the OpenAI API, and the python target's
``forge_decoder_waiting`` and ``forge_decoder_sequences`` on Triton's metrics endpoint behind them.

A random-weight GPT-2 of 8192 positions (the conftest's shape otherwise), built with ``-o inflight_sequences=2``
twice: the engine inside the stub (the engine layout: an ensemble, --decoupled) and in a process of its own (the
LLM-API layout), served by one real tritonserver with an OpenAI front on each, as forge serve starts them. Five
long generations at once leave three waiting while two decode; once their clients leave, both gauges read 0.
Bad inputs tried: a metrics endpoint that stops answering, one that answers no Prometheus text (the last
figures stand and the failures are counted; the scrape still answers).
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time
import urllib.request

import pytest

from test_python_target import metric

CAPACITY, CLIENTS = 2, 5  # -o inflight_sequences; generations sent at once
POSITIONS = 8192  # each generation outlasts what the test watches (about 1 ms a token on a 2-core CPU)


def scrape(url: str) -> dict[str, float]:
    """The front's ``/metrics`` samples without labels other than the served model's (name → value)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if set(s.labels) <= {"model_name"}}


def until(check, timeout: float = 60.0, what: str = ""):
    """``check()``'s first true answer within ``timeout`` s, polled every 0.2 s."""
    deadline = time.monotonic() + timeout
    while True:
        seen = check()
        if seen or time.monotonic() > deadline:
            assert seen, f"not within {timeout:g} s: {what}"
            return seen
        time.sleep(0.2)


@pytest.fixture(scope="module")
def saturated(tmp_path_factory):
    """(tritonserver, {name prefix: OpenAIServer}) over both builds."""
    from serve_models import make_gpt2

    from forge.cli import main
    from forge.openai_front import OpenAIServer
    from forge.server.triton_server import TritonServer
    from forge.testing import merge_repositories

    root = tmp_path_factory.mktemp("waiting")
    model = make_gpt2(root / "gpt2-long", n_positions=POSITIONS)
    common = ["build", "--family", "gpt", "--model", str(model), "--dtype", "float32", "--target", "python",
              "-o", "compute_dtype=float32", "--max-input-len", "64", "--max-seq-len", str(POSITIONS),
              "-o", f"inflight_sequences={CAPACITY}"]
    builds = {"q_": ["--backend-version", "v1.2.1", "--decoupled"],
              "qp_": ["--backend-version", "latest", "-o", "engine_process=true"]}
    for prefix, extra in builds.items():
        assert main([*common, *extra, "--name-prefix", prefix, "--out", str(root / prefix)]) == 0
    repo = merge_repositories([root / prefix for prefix in builds], root / "repo")
    with TritonServer(repo, log_file=root / "tritonserver.log", startup_timeout=900.0) as server:
        fronts = {prefix: OpenAIServer(root / prefix, server.grpc_url, port=0, metrics_url=server.metrics_url).start()
                  for prefix in builds}
        try:
            yield server, fronts
        finally:
            for front in fronts.values():
                front.stop()


@pytest.mark.heavy
@pytest.mark.parametrize("prefix", ["q_", "qp_"], ids=["engine-in-stub", "engine-process"])
def test_waiting_counts_what_the_engine_has_not_admitted(saturated, prefix):
    server, fronts = saturated
    front = fronts[prefix]
    base, decoder = front.url.removesuffix("/v1"), f"{prefix}tensorrt_llm"
    body = json.dumps({"model": front.catalog.model_id, "prompt": "hello world", "max_tokens": POSITIONS - 64,
                       "ignore_eos": True, "temperature": 0})
    clients = []
    for _ in range(CLIENTS):  # not streamed: nothing comes back before the end, the engine process ships no update
        connection = http.client.HTTPConnection(base.removeprefix("http://"), timeout=120)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        clients.append(connection)
    try:
        until(lambda: metric(server, "forge_decoder_waiting", model=decoder) == CLIENTS - CAPACITY
              and metric(server, "forge_decoder_sequences", model=decoder) == CLIENTS,
              what=f"{decoder}: {CLIENTS - CAPACITY} waiting of {CLIENTS}")
        busy = until(lambda: (lambda m: m if m["vllm:num_requests_waiting"] == CLIENTS - CAPACITY else None)(
            scrape(base)), what=f"{CLIENTS - CAPACITY} requests waiting on the front")
        assert busy["vllm:num_requests_running"] == CAPACITY
    finally:
        for connection in clients:  # the clients leave: the front cancels their requests, queued or decoding
            connection.close()
    until(lambda: metric(server, "forge_decoder_sequences", model=decoder) == 0
          and metric(server, "forge_decoder_waiting", model=decoder) == 0, what=f"{decoder} idle")
    idle = until(lambda: (lambda m: m if m["vllm:num_requests_waiting"] == m["vllm:num_requests_running"] == 0
                          else None)(scrape(base)), what="the front idle")
    assert idle["forge_openai_metrics_read_errors_total"] == 0


class _Endpoint(http.server.BaseHTTPRequestHandler):
    """A metrics endpoint answering ``text`` (None: it hangs up without an answer)."""

    text: str | None = None

    def do_GET(self):
        if self.text is None:
            self.close_connection = True
            return
        data = self.text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_a_failed_read_keeps_the_last_figures_and_is_counted(monkeypatch):
    from forge.openai_front import scheduler_stats
    from forge.openai_front.metrics import Metrics
    from forge.openai_front.scheduler_stats import SchedulerStats

    endpoint = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    monkeypatch.setattr(scheduler_stats, "CACHE_S", 0.0)  # every scrape reads
    try:
        metrics = Metrics("m")
        stats = SchedulerStats(f"http://127.0.0.1:{endpoint.server_port}/metrics",
                               ["ensemble", "preprocessing", "tensorrt_llm"], metrics.read_errors.inc)

        def exposed() -> dict[str, float]:
            from prometheus_client.parser import text_string_to_metric_families

            metrics.scheduled = stats.refresh()
            return {s.name: s.value for f in text_string_to_metric_families(metrics.exposition().decode())
                    for s in f.samples if not s.name.endswith("_created")}

        _Endpoint.text = "\n".join([
            'nv_inference_pending_request_count{model="ensemble",version="1"} 0',
            'nv_inference_pending_request_count{model="preprocessing",version="1"} 1',
            'nv_inference_pending_request_count{model="other",version="1"} 9',  # another model's queue
            'forge_decoder_waiting{model="tensorrt_llm"} 3', 'forge_decoder_sequences{model="tensorrt_llm"} 5'])
        first = exposed()
        assert (first["vllm:num_requests_waiting"], first["vllm:num_requests_running"]) == (4, 2)
        _Endpoint.text = None  # hangs up
        assert exposed()["vllm:num_requests_waiting"] == 4
        _Endpoint.text = 'forge_decoder_waiting{model="tensorrt_llm"} not-a-number'
        after = exposed()
        assert (after["vllm:num_requests_waiting"], after["vllm:num_requests_running"]) == (4, 2)
        assert after["forge_openai_metrics_read_errors_total"] == 2
        _Endpoint.text = 'nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 2'
        back = exposed()  # no forge decoder: running is the front's own count of its generations (none here)
        assert (back["vllm:num_requests_waiting"], back["vllm:num_requests_running"]) == (2, 0)
    finally:
        endpoint.shutdown()
        endpoint.server_close()
