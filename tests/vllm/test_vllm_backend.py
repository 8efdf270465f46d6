"""forge's ``vllm`` backend in the real tritonserver, its engine process played by ``fake_engine.py`` (no vLLM):
the tensor interface, per-request errors, a fatal start and a dead engine process."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import build  # noqa: E402

FAKE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory) -> Path:
    """A ``FORGE_VLLM_PYTHON`` that runs fake_engine.py instead of forge_vllm_engine.py."""
    path = tmp_path_factory.mktemp("fake") / "python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def served(tiny_llama, fake_python, tmp_path_factory):
    from forge.server.triton_server import TritonServer
    from forge.testing import serving_environment

    root = tmp_path_factory.mktemp("served")
    with serving_environment(root / "cache", FORGE_VLLM_PYTHON=str(fake_python)):
        repo = build(tiny_llama, root / "repo")
        with TritonServer(repo, startup_timeout=120) as server:
            yield server


def _generate(server, body: dict, route: str = "generate") -> tuple[int, object]:
    status, data = server.request(f"/v2/models/ensemble/{route}", "POST", json.dumps(body).encode(), timeout=30)
    if route == "generate_stream":
        return status, [json.loads(line[5:]) for line in data.decode().splitlines() if line.startswith("data:")]
    return status, json.loads(data)


def test_an_answer_with_and_without_the_prompt_and_the_outputs_asked_for(served):
    assert _generate(served, {"text_input": "abc"}) == (200, {"model_name": "ensemble", "model_version": "1",
                                                             "text_output": "abcABC"})
    status, body = _generate(served, {"text_input": "abc", "exclude_input_in_output": True,
                                      "return_num_input_tokens": True, "sampling_parameters": '{"max_tokens": 4}'})
    assert status == 200 and body["text_output"] == "ABC" and body["num_input_tokens"] == 3


def test_images_reach_the_engine_as_the_vllm_backend_takes_them(served):
    """``image``: base64 images, as many as the request holds, passed to the engine in order."""
    import base64

    images = [base64.b64encode(bytes(n)).decode() for n in (3, 5)]
    status, body = _generate(served, {"text_input": "see", "image": images, "exclude_input_in_output": True})
    assert status == 200 and body["text_output"] == "SEE[3 bytes][5 bytes]", body


def test_streaming_answers_piece_by_piece(served):
    status, events = _generate(served, {"text_input": "hello", "stream": True}, "generate_stream")
    assert status == 200 and [e["text_output"] for e in events] == list("HELLO")


@pytest.mark.parametrize("body,message", [
    ({"sampling_parameters": "{not json"}, "sampling_parameters is not JSON"),
    ({"sampling_parameters": "[1, 2]"}, "sampling_parameters must be a JSON object"),
    ({"sampling_parameters": '{"bogus": 1}'}, "unknown sampling parameter bogus"),
    ({"sampling_parameters": '{"lora_name": "a"}'}, "LoRA feature is not enabled"),
    ({"stream": True, "exclude_input_in_output": False}, "exclude_input_in_output = false is not allowed"),
    ({"embedding_request": "{}"}, "answers no embedding_request"),
], ids=["not-json", "not-object", "unknown-key", "lora", "stream-with-prompt", "embedding"])
def test_a_bad_request_fails_alone(served, body, message):
    status, answer = _generate(served, {"text_input": "abc", **body},
                               "generate_stream" if body.get("stream") else "generate")
    text = json.dumps(answer)
    assert message in text, text
    assert _generate(served, {"text_input": "ok", "exclude_input_in_output": True})[1]["text_output"] == "OK"


def test_an_engine_that_does_not_start_fails_the_load_with_its_reason(tiny_llama, fake_python, tmp_path):
    from forge.errors import ForgeError
    from forge.server.triton_server import TritonServer
    from forge.testing import serving_environment

    with serving_environment(tmp_path / "cache", FORGE_VLLM_PYTHON=str(fake_python)):
        repo = build(tiny_llama, tmp_path / "repo")
        model_json = repo / "ensemble" / "1" / "model.json"
        model_json.write_text(json.dumps({**json.loads(model_json.read_text()), "model": "/fail"}))
        with pytest.raises(ForgeError, match="did not start: ValueError: no such model"):
            TritonServer(repo, startup_timeout=60).start()
    from forge.server.processes import repository_processes

    assert not repository_processes(repo)


def test_vllms_statistics_are_tritons_metrics_by_the_vllm_backends_names(served):
    """The engine's statistics of each step (the fake engine: one per answer) on tritonserver's metrics port."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, float]:
        with urllib.request.urlopen(served.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return {s.name + ("" if "le" not in s.labels else f"[{s.labels['le']}]"): s.value
                for family in text_string_to_metric_families(text) for s in family.samples
                if s.name.startswith("vllm:") and s.labels.get("model") == "ensemble"
                and s.labels.get("version") == "1"}

    before = samples()
    assert _generate(served, {"text_input": "metric", "exclude_input_in_output": True})[0] == 200
    expected = {"vllm:prompt_tokens_total": 6, "vllm:generation_tokens_total": 6,
                "vllm:time_to_first_token_seconds_count": 1, "vllm:time_to_first_token_seconds_bucket[0.04]": 1,
                "vllm:time_to_first_token_seconds_bucket[0.02]": 0, "vllm:e2e_request_latency_seconds_sum": 2,
                "vllm:request_prompt_tokens_bucket[10]": 1, "vllm:request_params_n_count": 1}
    deadline = time.monotonic() + 10
    while True:  # a scrape may come while the stub is adding the step's statistics: until all are there
        after = samples()
        grew = {name: after.get(name, 0) - before.get(name, 0) for name in expected}
        if grew == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert grew == expected
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_many_concurrent_answers_while_clients_are_watched_for_cancellation(served):
    """The cancellation watcher asks each waiting request's client every 0.1 s while the reader answers them; a
    request answered meanwhile must not be asked about (that crashed tritonserver at 32 concurrent requests)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        return _generate(served, {"text_input": f"q{i}", "exclude_input_in_output": True})[0]

    with ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(one, range(3000)))
    assert statuses == [200] * 3000
    assert served.process.poll() is None


def test_forge_infer_asks_it(served, capsys):
    from forge.cli import main

    assert main(["infer", "abc", "--url", f"http://{served.http_url}", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip() == "ABC"  # the answer alone, as from the other targets
    assert main(["infer", "abc", "--url", f"http://{served.http_url}", "--grpc-url", served.grpc_url, "--max-tokens",
                 "5", "--stream"]) == 0
    assert "ABC" in capsys.readouterr().out


def test_forge_bench_loads_it(served, capsys):
    from forge.cli import main

    code = main(["bench", served.grpc_url, "--concurrency", "2", "--warmup", "0", "--json", "token-norm-dist",
                 "--num-requests", "4", "--input-mean", "8", "--input-stdev", "0", "--output-mean", "4",
                 "--output-stdev", "0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out)
    assert result["succeeded"] == 4 and result["errors"] == 0 and result["output_tokens"] > 0, result


def test_a_dead_engine_fails_its_requests_and_ends_the_model_process(served):  # last: the model is gone after
    from forge.server.processes import cmdline, repository_processes

    stubs = [p for p in repository_processes(served.repo) if "triton_python_backend_stub" in " ".join(cmdline(p))]
    status, body = _generate(served, {"text_input": "die"})
    assert status >= 400 and "the vLLM engine process of model 'ensemble' exited with status 3" in body["error"]
    for _ in range(50):
        if not any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
                   for pid in stubs):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the model process outlived its engine")
