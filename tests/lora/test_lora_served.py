"""Multi-LoRA on the real tritonserver (python target): answers equal transformers + PEFT, mixed batches,
tensorrtllm_backend's task-id cache protocol, and `forge infer --lora`."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from lora_models import greedy, peft_model

pytestmark = pytest.mark.heavy

PROMPTS = {"gpt": [[5, 17, 33, 40], [7, 8, 9], [100, 3, 60, 70, 80, 12]],
           "llama": [[1, 40, 41, 42], [1, 60, 70], [1, 10, 20, 30, 44, 55]]}
NEW_TOKENS = 8
PREFIX = {"gpt": "g_", "llama": "l_"}


@pytest.fixture(scope="module")
def references(models):
    """transformers (+ PEFT) greedy continuations: family → adapter (None: base) → one per prompt."""
    result = {}
    for fam in ("gpt", "llama"):
        result[fam] = {}
        for adapter in (None, "A", "B"):
            model = peft_model(models[fam], None if adapter is None else models[f"{fam}_{adapter}"])
            result[fam][adapter] = [greedy(model, p, NEW_TOKENS) for p in PROMPTS[fam]]
    return result


@pytest.fixture(scope="module")
def grpc(server):
    from forge.clients.inference import GrpcSession

    with GrpcSession(server.grpc_url) as session:
        yield session


def adapter_arrays(repo, fam, task_id):
    folder = repo / f"{PREFIX[fam]}tensorrt_llm" / "lora" / str(task_id)
    return np.load(folder / "model.lora_weights.npy"), np.load(folder / "model.lora_config.npy")


def ask(session, fam, prompt, *, task_id=None, weights=None):
    """One request to the family's tensorrt_llm model; the generated ids."""
    tensors = {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
               "request_output_len": np.array([[NEW_TOKENS]], np.int32)}
    if task_id is not None:
        tensors["lora_task_id"] = np.array([[task_id]], np.uint64)
    if weights is not None:
        tensors["lora_weights"], tensors["lora_config"] = weights[0].astype(np.float16), weights[1].astype(np.int32)
    out = session.infer(f"{PREFIX[fam]}tensorrt_llm", tensors, timeout_s=120)
    ids = out["output_ids"].reshape(-1).tolist()
    return ids[len(prompt):out["sequence_length"].reshape(-1)[0]]


def test_each_adapter_answers_like_transformers_and_peft(grpc, repos, references):
    # gpt: the adapters were loaded when the model started (lora_prefetch_dir); the id alone selects them
    for n, adapter in enumerate(("A", "B"), start=1):
        for prompt, expected in zip(PROMPTS["gpt"], references["gpt"][adapter]):
            assert ask(grpc, "gpt", prompt, task_id=n) == expected
    for prompt, expected in zip(PROMPTS["gpt"], references["gpt"][None]):
        assert ask(grpc, "gpt", prompt) == expected
    assert references["gpt"]["A"] != references["gpt"][None] != references["gpt"]["B"]  # the adapters matter


def test_mixed_concurrent_batch_gives_each_request_its_own_answer(grpc, server, references):
    from forge.clients.inference import GrpcSession

    jobs = [(adapter, i) for adapter in (None, "A", "B") for i in range(len(PROMPTS["gpt"]))] * 2
    answers: dict[int, list[int]] = {}
    start = threading.Barrier(len(jobs))

    def run(k, adapter, i):
        with GrpcSession(server.grpc_url) as session:
            start.wait()
            answers[k] = ask(session, "gpt", PROMPTS["gpt"][i], task_id=None if adapter is None else " AB".index(adapter))

    threads = [threading.Thread(target=run, args=(k, a, i)) for k, (a, i) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert {k: answers.get(k) for k in range(len(jobs))} == {k: references["gpt"][a][i] for k, (a, i) in enumerate(jobs)}


def test_backend_cache_protocol_weights_first_then_id_unknown_is_an_error(grpc, repos, references, models):
    """v0.15.0 repository (no prefetch), a cache for one adapter: tensorrtllm_backend's semantics."""
    from forge.errors import ForgeError

    a, b = adapter_arrays(repos["llama"], "llama", 1), adapter_arrays(repos["llama"], "llama", 2)
    prompt, ref = PROMPTS["llama"][0], references["llama"]
    with pytest.raises(ForgeError, match="LoRA task 1 not found in cache. Please send LoRA weights with request"):
        ask(grpc, "llama", prompt, task_id=1)
    assert ask(grpc, "llama", prompt, task_id=1, weights=a) == ref["A"][0]  # first request carries the adapter
    assert ask(grpc, "llama", PROMPTS["llama"][1], task_id=1) == ref["A"][1]  # then the id is enough
    assert ask(grpc, "llama", prompt, task_id=2, weights=b) == ref["B"][0]  # loading B evicts A (cache for one)
    with pytest.raises(ForgeError, match="LoRA task 1 not found in cache"):
        ask(grpc, "llama", prompt, task_id=1)
    assert ask(grpc, "llama", PROMPTS["llama"][2], task_id=2) == ref["B"][2]
    assert ask(grpc, "llama", prompt) == ref[None][0]  # the model kept serving
    # weights without an id: applied to that request only (tensorrtllm_backend v0.8 style)
    assert ask(grpc, "llama", PROMPTS["llama"][2], weights=a) == ref["A"][2]


@pytest.mark.parametrize("change,message", [
    (lambda w, c: (w, np.where(c == 1, 8, c)), "module id 8 at layer 0 is not a LoRA module of this model"),
    (lambda w, c: (w[:, :, :100], c), "lora_weights row 0 has 100 values; module id 1 at rank 4 needs 512"),
    (lambda w, c: (w, c[:, :3]), "lora_config [3, 3] must be [rows, 3] with one row per lora_weights row (6)"),
    (lambda w, c: (w, np.where(c == 4, 99, c)), "adapter size 99 is outside 1…64"),
])
def test_bad_lora_tensors_are_a_per_request_error(grpc, repos, references, change, message):
    from forge.errors import ForgeError

    w, c = change(*adapter_arrays(repos["llama"], "llama", 1))
    with pytest.raises(ForgeError, match=re.escape(message)):
        ask(grpc, "llama", PROMPTS["llama"][0], task_id=7, weights=(w, c))
    assert ask(grpc, "llama", PROMPTS["llama"][0]) == references["llama"][None][0]


def forge_cli(*argv):
    return subprocess.run([sys.executable, "-m", "forge", *argv], capture_output=True, text=True, timeout=300)


def test_forge_infer_lora_through_the_ensemble(server, repos, models):
    """`forge infer --lora NAME --repo REPO`: the name's task id; weights sent when the server lacks them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["llama"])
    prompt = "abc"
    ids = tokenizer(prompt)["input_ids"]
    urls = ["--url", server.http_url, "--grpc-url", server.grpc_url, "--model", "l_ensemble",
            "--max-tokens", str(NEW_TOKENS)]
    for name in ("A", "B", "A"):  # A was evicted by B: the retry sends A's weights again
        result = forge_cli("infer", prompt, *urls, "--lora", name, "--repo", str(repos["llama"]))
        assert result.returncode == 0, result.stderr
        expected = greedy(peft_model(models["llama"], models[f"llama_{name}"]), ids, NEW_TOKENS, eos=2)
        assert result.stdout.strip() == tokenizer.decode(ids + expected, skip_special_tokens=True).strip()
    missing = forge_cli("infer", prompt, *urls, "--lora", "C", "--repo", str(repos["llama"]))
    assert missing.returncode == 2 and missing.stderr.strip() == (
        f"forge: error: {repos['llama']} has no LoRA adapter 'C'; its adapters: A, B")
    unknown = forge_cli("infer", prompt, *urls, "--lora", "9")
    assert unknown.returncode == 1 and "LoRA task 9 not found in cache" in unknown.stderr


def test_forge_bench_mixes_adapters(server, repos):
    """`forge bench --lora A,B,base`: requests take the adapters in turn; every request succeeds."""
    import json

    for model, repo, words in (("g_tensorrt_llm", repos["gpt"], "6"), ("l_ensemble", repos["llama"], "1")):
        result = forge_cli("bench", server.grpc_url, "--model", model, "--lora", "A,B,base", "--lora-repo", str(repo),
                           "--concurrency", "3", "--json", "token-norm-dist", "--num-requests", "9",
                           "--input-mean", words, "--output-mean", "4")
        assert result.returncode == 0, result.stdout + result.stderr
        summary = json.loads(result.stdout)
        assert summary["succeeded"] == 9 and summary["errors"] == 0, summary
        assert summary["lora"] == ["A", "B", "base"]
    refused = forge_cli("bench", server.http_url, "--protocol", "http", "--model", "l_ensemble", "--lora", "A",
                        "--lora-repo", str(repos["llama"]), "token-norm-dist", "--num-requests", "2")
    assert refused.returncode == 2 and "--lora sends LoRA tensors over gRPC" in refused.stderr


def test_ensemble_and_bls_pass_the_lora_inputs(grpc):
    """The ensemble and the BLS model feed lora_task_id to tensorrt_llm: both answer with the adapter."""
    def text(model, task_id=None):
        tensors = {"text_input": np.array([[b"hello world"]], object), "max_tokens": np.array([[NEW_TOKENS]], np.int32)}
        if task_id is not None:
            tensors["lora_task_id"] = np.array([[task_id]], np.uint64)
        return grpc.infer(model, tensors, timeout_s=120)["text_output"].reshape(-1)[0]

    for task_id in (None, 1, 2):
        assert text("g_ensemble", task_id) == text("g_tensorrt_llm_bls", task_id)
    assert len({text("g_ensemble", t) for t in (None, 1, 2)}) == 3


def test_each_adapter_is_an_openai_model_id(server, repos, models):
    """The OpenAI API lists the repository and one id per adapter; each id answers as `forge infer --lora` (the
    weights go along when the server does not hold the adapter: the cache here holds one at a time)."""
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    from forge.openai_front import OpenAIServer

    tokenizer = AutoTokenizer.from_pretrained(models["llama"])
    prompt = "abc"
    ids = tokenizer(prompt)["input_ids"]
    front = OpenAIServer(repos["llama"], server.grpc_url, port=0).start()
    try:
        api = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in api.models.list().data] == [repos["llama"].name, "A", "B"]
        assert api.models.retrieve("A").owned_by == "forge"
        answers = {}
        for name in ("A", "B", "A", None):
            answer = api.completions.create(model=name or repos["llama"].name, prompt=prompt, temperature=0,
                                            max_tokens=NEW_TOKENS)
            model = peft_model(models["llama"], None if name is None else models[f"llama_{name}"])
            expected = greedy(model, ids, NEW_TOKENS, eos=2)
            whole = tokenizer.decode(ids + expected, skip_special_tokens=True)
            shown = tokenizer.decode(ids, skip_special_tokens=True)  # v0.15.0 echoes the prompt: the API strips it
            assert answer.choices[0].text.strip() == whole.removeprefix(shown).strip(), name
            answers[name] = answer.choices[0].text
        assert answers["A"] != answers["B"]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            api.completions.create(model="C", prompt=prompt, max_tokens=2)
    finally:
        front.stop()
