"""forge infer and forge bench against the session's server; forge serve in the foreground as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from forge.cli import main

pytestmark = pytest.mark.heavy

PROMPT = "What is machine learning?"


def test_infer_prints_the_generated_text(server, capsys):
    assert main(["infer", PROMPT, "--max-tokens", "8", "--url", server.http_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and len(out.strip()) > len(PROMPT)


def test_infer_json_and_sampling_flags(server, capsys):
    args = ["infer", PROMPT, "--max-tokens", "8", "--url", server.http_url, "--json", "--top-k", "20",
            "--temperature", "1.2", "--seed", "5"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["text_output"] == first["text_output"]


def test_infer_streams_tokens_over_grpc(server, capsys):
    assert main(["infer", PROMPT, "--max-tokens", "6", "--model", "s_ensemble", "--stream",
                 "--grpc-url", server.grpc_url, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["cancelled"] is False and answer["text_output"]


def test_infer_stop_after_ms_cancels(server, capsys):
    assert main(["infer", PROMPT, "--max-tokens", "100", "--model", "s_ensemble", "--stream",
                 "--grpc-url", server.grpc_url, "--stop-after-ms", "1"]) == 0
    assert "cancelled" in capsys.readouterr().err


def test_infer_reports_server_errors_in_one_line(server, capsys):
    """Bad request: a prompt longer than the model's max input length, through forge infer."""
    assert main(["infer", "hello " * 200, "--max-tokens", "4", "--url", server.http_url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("forge: error: the server refused the request") and "max_input_len" in err
    assert len(err.strip().splitlines()) == 1


def test_infer_without_a_server_says_so(capsys):
    assert main(["infer", PROMPT, "--url", "127.0.0.1:9"]) == 1
    assert "cannot reach a Triton server at 127.0.0.1:9" in capsys.readouterr().err


def test_bench_token_norm_dist_closed_loop(server, capsys):
    assert main(["bench", server.grpc_url, "--concurrency", "4", "--json", "token-norm-dist", "--num-requests", "8",
                 "--input-mean", "12", "--input-stdev", "4", "--output-mean", "6", "--output-stdev", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["errors"] == 0 and summary["succeeded"] == 8 and summary["req_per_s"] > 0
    assert summary["output_tokens"] > 8 and summary["latency_ms"]["p99"] >= summary["latency_ms"]["p50"]
    assert summary["first_token_ms"] is None


def test_bench_streaming_open_loop_reports_first_token_latency(server, capsys):
    assert main(["bench", server.grpc_url, "--model", "s_tensorrt_llm", "--request-rate", "50", "--stream",
                 "token-norm-dist", "--num-requests", "6", "--input-mean", "8", "--output-mean", "5", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["errors"] == 0 and summary["output_tokens"] == 30
    assert summary["first_token_ms"]["p50"] <= summary["latency_ms"]["p50"]


def test_bench_text_prompts_against_the_ensemble(server, capsys, tiny_gpt2):
    assert main(["bench", server.grpc_url, "--concurrency", "2", "--tokenizer", str(tiny_gpt2),
                 "prompts", "--prompt", PROMPT, "--prompt", "hello world", "--output-len", "5",
                 "--num-requests", "4"]) == 0
    out = capsys.readouterr().out
    assert "req/s" in out and "4/4 requests" in out


def test_bench_repository_starts_its_own_server(repos, capsys):
    assert main(["bench", str(repos[""]), "--concurrency", "2", "--json", "token-norm-dist", "--num-requests", "4",
                 "--input-mean", "8", "--output-mean", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["succeeded"] == 4


def _forge(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from forge.cli import run; run()", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_serve_runs_in_the_foreground_and_stops_everything_on_sigterm(repos, tmp_path):
    from forge.server.processes import free_ports

    ports = [str(port) for port in free_ports(3)]
    log = tmp_path / "server.log"
    proc = _forge("serve", str(repos[""]), "--http-port", ports[0], "--grpc-port", ports[1],
                  "--metrics-port", ports[2], "--log-file", str(log), start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(lines)
        assert f"HTTP     http://127.0.0.1:{ports[0]}" in text, text + proc.stderr.read()
        assert "4 models READY" in text
        body = json.dumps({"text_input": PROMPT, "max_tokens": 4, "bad_words": "", "stop_words": ""}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/v2/models/ensemble/generate", data=body)
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["text_output"].startswith(PROMPT)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    leftovers = subprocess.run(["pgrep", "-f", f"--model-repository={repos[''].resolve()}"],
                               capture_output=True, text=True).stdout.split()
    assert leftovers == [], "tritonserver or its python stubs outlived forge serve"
