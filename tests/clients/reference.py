"""What lm-evaluation-harness should score for the tasks of ``tasks/``, computed here with transformers in float32:
the same prompts rendered from the same YAML and data files, scored the way lm-eval scores them.

- ``generate_until``: greedy generation of at most ``max_gen_toks`` tokens (ending at the model's EOS token),
  cut at the first ``until`` string or the tokenizer's EOS string (lm-eval adds it to the stops), then the
  task's filters (``remove_whitespace``) and ``exact_match`` with ``ignore_case`` and ``ignore_punctuation``.
- ``multiple_choice``: each choice's continuation is the target delimiter (a space) and the choice; its score is
  the sum of the log-probabilities of its tokens after the context, the highest score wins (``acc``). Context
  and continuation are tokenized as lm-eval's ``TemplateLM._encode_pair`` does for a causal model: the context's
  trailing spaces move to the continuation, context + continuation is encoded whole and split at the length of
  the context encoded alone, without special tokens.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

TASKS = Path(__file__).parent / "tasks"


@dataclass(frozen=True)
class Task:
    """One task of ``tasks/``: its YAML and its documents, in file order (lm-eval's ``doc_id``)."""

    name: str
    config: dict
    docs: list[dict]

    def context(self, doc: dict) -> str:
        """The prompt lm-eval builds for ``doc`` (zero-shot, no description)."""
        return render(self.config["doc_to_text"], doc)

    def choices(self, doc: dict) -> list[str]:
        """The continuations lm-eval scores for ``doc`` (target delimiter, then the choice)."""
        return [self.config.get("target_delimiter", " ") + choice for choice in doc[self.config["doc_to_choice"]]]

    def gold(self, doc: dict):
        """The target: the answer's text (generate_until) or the right choice's index (multiple_choice)."""
        if self.config["output_type"] == "multiple_choice":
            return doc[self.config["doc_to_target"]]
        return render(self.config["doc_to_target"], doc)


def render(template: str, doc: dict) -> str:
    """A jinja template rendered as lm-eval's ``utils.apply_template`` renders it."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.BaseLoader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(template).render(**doc)


def load_task(name: str) -> Task:
    """The task ``tasks/<name>.yaml`` with the documents of its test split's data file."""
    import yaml

    config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
    data = TASKS / config["dataset_kwargs"]["data_files"][config["test_split"]]
    docs = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    return Task(name, config, docs)


class Reference:
    """SmolLM2 in transformers, float32, on the CPU: the answers and scores a correct server gives."""

    def __init__(self, hf_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()

    def generate_until(self, context: str, until: list[str], max_gen_toks: int) -> str:
        """The greedy continuation of ``context``, cut at the first stop string (not included)."""
        encoded = self.tokenizer(context, return_tensors="pt")
        with self.torch.no_grad():
            out = self.model.generate(**encoded, max_new_tokens=max_gen_toks, do_sample=False,
                                      pad_token_id=self.tokenizer.eos_token_id)
        text = self.tokenizer.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=False)
        for stop in [*until, self.tokenizer.eos_token]:
            text = text.split(stop)[0]
        return text

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's ``_encode_pair`` for a causal model."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer(context + continuation, add_special_tokens=False).input_ids
        context_len = len(self.tokenizer(context, add_special_tokens=False).input_ids)
        return whole[:context_len], whole[context_len:]

    def loglikelihood(self, context: str, continuation: str) -> float:
        """The sum of the log-probabilities of ``continuation``'s tokens after ``context``."""
        context_ids, continuation_ids = self.encode_pair(context, continuation)
        ids = self.torch.tensor([context_ids + continuation_ids])
        with self.torch.no_grad():
            logprobs = self.torch.log_softmax(self.model(ids).logits[0].float(), dim=-1)
        # the token at position i is predicted by the logits at position i - 1
        positions = range(len(context_ids), len(context_ids) + len(continuation_ids))
        return float(sum(logprobs[i - 1, ids[0, i]] for i in positions))


def exact_match(prediction: str, target: str) -> bool:
    """The task's filter and metric: stripped, then compared ignoring case and punctuation."""
    table = str.maketrans("", "", string.punctuation)
    return prediction.strip().lower().translate(table) == target.lower().translate(table)
