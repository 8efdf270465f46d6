"""The python target behind the LLM-API interface: text requests in, text responses out, forge's engine between.

Under a TensorRT-LLM release without engines the ``tensorrt_llm`` model takes ``text_input`` and
``sampling_param_*`` and answers ``text_output`` (``forge_llmapi`` checks and maps them, the same module the
``tensorrtllm`` target's model uses). This front tokenizes the prompt, turns the request into the token
tensors :func:`forge_decoder.request.parse` reads, and turns the engine's results back into text: streamed
pieces never split a character, a non-streamed answer is the decode of every generated token, and the prompt
leads ``text_output`` unless the request sets ``sampling_param_exclude_input_from_output``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

import forge_llmapi
import forge_text

# the engine's finish reasons → the LLM API's
FINISH = {"length": "length", "end_id": "stop", "stop_words": "stop", "cancelled": "cancelled", "error": "error"}


class TextFront:
    """Tokenizer, end ids and the request mapping of one LLM-API model of the python target."""

    def __init__(self, tokenizer_dir: str, params: Mapping[str, str], *, trust_remote_code: bool = False):
        self.tokenizer = forge_text.load_tokenizer(tokenizer_dir, trust_remote_code=trust_remote_code, fast=True)
        forge_text.token_ids("", self.tokenizer, False)  # the first encode resets truncation: never under load
        self.add_special = forge_text.parse_bool(params.get("add_special_tokens"), True)
        self.codec = forge_text.TokenBytes(self.tokenizer, forge_text.parse_bool(params.get("skip_special_tokens"),
                                                                                  True))
        self.end_id = int(params["end_id"])
        self.pad_id = int(params.get("pad_id") or self.end_id)
        self.stop_ids = [int(t) for t in str(params.get("stop_token_ids") or "").split(",") if t.strip()]
        self.vocab_size = int(params.get("vocab_size") or len(self.tokenizer))
        self.multimodal = forge_text.parse_bool(params.get("multimodal"), False)
        # the adapters shipped in the model's lora/ folder: name → task id (the engine holds them by task id)
        self.adapters = {str(k): int(v) for k, v in json.loads(params.get("lora_names") or "{}").items()}

    def request(self, tensors: Mapping[str, np.ndarray], *, decoupled: bool,
                max_tokens_limit: int | None) -> tuple[forge_llmapi.LLMRequest, dict[str, np.ndarray]]:
        """The checked LLM-API request and the token tensors of the same generation (one row)."""
        parsed = forge_llmapi.parse(tensors, decoupled=decoupled, multimodal=self.multimodal,
                                    max_tokens_limit=max_tokens_limit)
        if parsed.images:
            raise forge_llmapi.RequestError("image_url: this python-target model is text-only")
        task_id = self._adapter(parsed.lora)
        if parsed.sampling.get("best_of", 1) != 1:
            raise forge_llmapi.RequestError("sampling_param_best_of above 1 is not served by the python target "
                                            "(one sequence per request)")
        if parsed.prompt_ids is not None:
            ids = parsed.prompt_ids
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise forge_llmapi.RequestError(f"{forge_llmapi.PROMPT_IDS}: token id {bad} is outside the "
                                                f"vocabulary [0, {self.vocab_size})")
            parsed.prompt = forge_text.decode(self.tokenizer, ids, False)  # what an echo shows
        else:
            ids = forge_text.token_ids(parsed.prompt, self.tokenizer, self.add_special)
        if not ids:
            raise forge_llmapi.RequestError("text_input encodes to no tokens")
        s = parsed.sampling
        token: dict[str, Any] = {
            "input_ids": [ids], "input_lengths": [[len(ids)]], "request_output_len": [[parsed.max_tokens]],
            # ignore_eos: no end id (TensorRT-LLM's -1), the repository's own stop_token_ids still end it
            "end_id": [[-1 if s.get("ignore_eos") else self.end_id]], "pad_id": [[self.pad_id]],
            "exclude_input_in_output": [[True]],
            "streaming": [[parsed.streaming]],
            "return_log_probs": [["cumulative_logprob" in parsed.returns]],
            "return_perf_metrics": [[bool(s.get("return_perf_metrics"))]],
        }
        if task_id is not None:
            token["lora_task_id"] = np.array([[task_id]], dtype=np.uint64)
        for keyword, name, kind in (("temperature", "temperature", np.float32), ("top_k", "runtime_top_k", np.int32),
                                    ("top_p", "runtime_top_p", np.float32),
                                    ("frequency_penalty", "frequency_penalty", np.float32),
                                    ("presence_penalty", "presence_penalty", np.float32),
                                    ("seed", "random_seed", np.uint64),
                                    ("min_tokens", "min_length", np.int32),
                                    ("repetition_penalty", "repetition_penalty", np.float32)):
            if keyword in s:
                token[name] = np.array([[s[keyword]]], dtype=kind)
        stops = [forge_text.token_ids(text, self.tokenizer, False) for text in s.get("stop", [])]
        stops = [w for w in stops if w] + [[t] for t in self.stop_ids]
        if stops:
            flat = [t for w in stops for t in w]
            offsets = list(np.cumsum([len(w) for w in stops]))
            token["stop_words_list"] = np.array([[flat, offsets + [-1] * (len(flat) - len(offsets))]], dtype=np.int32)
        arrays = {k: v if isinstance(v, np.ndarray) else np.array(v, dtype=_DTYPES.get(k, np.int32))
                  for k, v in token.items()}
        return parsed, arrays

    def _adapter(self, lora: dict | None) -> int | None:
        """The task id of the request's adapter: one the build shipped, named as it was (its lora_path names the
        adapter's folder on the server, which this model holds already)."""
        if lora is None:
            return None
        if not self.adapters:
            raise forge_llmapi.RequestError("lora_id / lora_name / lora_path: this model was built without LoRA "
                                            "adapters")
        task_id = self.adapters.get(lora["lora_name"])
        if task_id is None:
            raise forge_llmapi.RequestError(f"no LoRA adapter {lora['lora_name']!r} here; this model serves "
                                            f"{', '.join(sorted(self.adapters))}")
        if lora["lora_int_id"] != task_id:
            raise forge_llmapi.RequestError(f"LoRA adapter {lora['lora_name']!r} is lora_id {task_id} here, "
                                            f"not {lora['lora_int_id']}")
        return task_id

    def token_text(self, token: int) -> str:
        """One token as text, special tokens included (a piece of a character shows as U+FFFD)."""
        return forge_text.decode(self.tokenizer, [token], False)

    def stream(self, parsed: forge_llmapi.LLMRequest) -> "TextStream":
        return TextStream(self, parsed)


_DTYPES = {"streaming": np.bool_, "exclude_input_in_output": np.bool_, "return_log_probs": np.bool_,
           "return_perf_metrics": np.bool_}


class TextStream:
    """One request's text so far: the prompt echo, the incremental decode, and its response tensors."""

    def __init__(self, front: TextFront, parsed: forge_llmapi.LLMRequest):
        self.front, self.parsed = front, parsed
        self.decoder = forge_text.IncrementalDetokenizer(front.codec)
        self.prefix = parsed.prompt if parsed.echo else ""
        self.text = ""  # every generated character so far (for the stop string that ended it)

    def ask(self, rows: list) -> None:
        """What the token tensors do not carry: the log-probs the request wants (its one row's)."""
        rows[0].top_logprobs = self.parsed.sampling.get("logprobs")
        rows[0].prompt_logprobs = self.parsed.sampling.get("prompt_logprobs")

    def _positions(self, positions: list) -> list:
        """toplogprobs.Position lists as the ``logprobs`` output's objects (None stays null)."""
        decode = self.front.token_text
        return [None if p is None else {str(t): {"logprob": lp, "rank": rank, "decoded_token": decode(t)}
                                        for t, lp, rank in p} for p in positions]

    def outputs(self, ids: list[int], result, final: bool, reason: str | None,
                configured: Mapping[str, np.dtype], wanted: set[str] | None) -> dict[str, np.ndarray]:
        """The response tensors for ``ids`` (new tokens when streaming, all generated ones otherwise)."""
        piece = self.decoder.push(ids) + (self.decoder.flush() if final else "")
        self.text += piece
        text, self.prefix = self.prefix + piece, ""
        stop_reason = None
        if final and reason == "stop_words":
            stop_reason = next((s for s in self.parsed.sampling.get("stop", []) if self.text.endswith(s)), None)
        perf = {"arrival_time_ns": result.arrival_ns, "first_scheduled_time_ns": result.scheduled_ns,
                "first_token_time_ns": result.first_token_ns, "last_token_time_ns": result.last_token_ns}
        completion = forge_llmapi.Completion(text=text, finish_reason=FINISH.get(reason or "") if final else None,
                                             stop_reason=stop_reason, cumulative_logprob=result.cum_logprob,
                                             perf=perf, tokens=(result.input_tokens, result.output_tokens))
        if "logprobs" in self.parsed.sampling:
            completion.logprobs = self._positions(result.top)
        if result.prompt_top is not None:
            completion.prompt_logprobs = self._positions(result.prompt_top)
        return forge_llmapi.outputs(completion, self.parsed, configured, wanted)
