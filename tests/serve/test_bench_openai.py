"""forge bench --api openai against forge serve's real OpenAI front over the session's real tritonserver.

The front serves the tiny GPT-2 built with --decoupled (streamed token by token). Its tokenizer has no chat
template, so the loads use /v1/completions; the chat endpoint's refusal shows as counted errors. Bad inputs
tried: --api openai without --url, a URL where nothing answers, a --model the server does not list,
--endpoint with --api triton, token-norm-dist without --tokenizer.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")]


@pytest.fixture(scope="module")
def front(server, repos):
    from forge.openai_front import OpenAIServer

    served = OpenAIServer(repos["s_"], server.grpc_url, port=0).start()
    try:
        yield served
    finally:
        served.stop()


def bench(capsys, *argv: str) -> tuple[int, str, str]:
    from forge.cli import main

    capsys.readouterr()
    code = main(["bench", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_streamed_completions_report_throughput_and_first_token_latency(front, capsys):
    code, out, err = bench(capsys, "--api", "openai", "--url", front.url, "--model", front.catalog.model_id,
                           "--endpoint", "completions", "--stream", "--concurrency", "2", "--json",
                           "prompts", "--prompt", "hello there, how are", "--prompt", "the quick brown fox",
                           "--num-requests", "6", "--output-len", "8")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["errors"] == 0 and summary["succeeded"] == 6
    assert summary["req_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["output_tokens"] > 6  # the server's usage.completion_tokens, several per request
    assert summary["first_token_ms"]["p50"] > 0
    assert summary["first_token_ms"]["p50"] <= summary["latency_ms"]["p50"]
    assert summary["inter_token_ms"] is not None  # token-by-token chunks from the decoupled build
    assert summary["api"] == "openai" and summary["endpoint"] == "completions" and summary["stream"] is True


def test_token_norm_dist_open_loop_with_tokenizer_prints_the_summary(front, tiny_gpt2, capsys):
    code, out, err = bench(capsys, "--api", "openai", "--url", front.url, "--endpoint", "completions",
                           "--tokenizer", str(tiny_gpt2), "--request-rate", "20",
                           "token-norm-dist", "--num-requests", "6", "--input-mean", "12", "--output-mean", "6")
    assert code == 0, err
    head, row = out.splitlines()[:2]
    assert head.split()[:3] == ["mode", "req/s", "tokens/s"]
    assert row.startswith("rate 20/s")
    req_s, tok_s = (float(v) for v in row.split()[2:4])
    assert req_s > 0 and tok_s > 0
    assert row.split()[-3:] == ["-", "-", "0"]  # not streamed: no TTFT (shown as '-', not 0), no errors
    assert "6/6 requests" in out


def test_requests_the_server_refuses_are_counted_errors(front, capsys):
    # the tiny tokenizer has no chat template: the front answers each chat request 400
    code, out, err = bench(capsys, "--api", "openai", "--url", front.url, "--concurrency", "2", "--json",
                           "--warmup", "0", "prompts", "--prompt", "hi", "--num-requests", "2", "--output-len", "4")
    assert code == 1
    summary = json.loads(out)
    assert summary["errors"] == 2 and summary["req_per_s"] == 0
    assert summary["first_error"].startswith("400") and "chat template" in summary["first_error"]


@pytest.mark.parametrize("argv, words", [
    (["--api", "openai", "prompts", "--prompt", "hi"], "needs the server's base URL"),
    (["--api", "openai", "--url", "http://127.0.0.1:1/v1", "prompts", "--prompt", "hi"], "cannot reach"),
    (["--api", "openai", "--url", "{url}", "--model", "nope", "prompts", "--prompt", "hi"],
     "has no model 'nope' (it has: s)"),
    (["127.0.0.1:8001", "--endpoint", "chat", "prompts", "--prompt", "hi"], "--endpoint is for --api openai"),
    (["--api", "openai", "--url", "{url}", "token-norm-dist"], "needs --tokenizer DIR"),
])
def test_bad_inputs_are_one_line_errors(front, capsys, argv, words):
    code, out, err = bench(capsys, *[a.replace("{url}", front.url) for a in argv])
    assert code == 2
    assert words in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
