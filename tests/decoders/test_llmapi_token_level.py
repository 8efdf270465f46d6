"""Token-level requests on the ``tensorrtllm`` target's LLM-API model: token-id prompts, log-probs, token counts.

TensorRT-LLM is not installed here, so ``model.py`` is tested up to the LLM API's boundary, as in
``test_llmapi.py``: what it hands the API (``forge_llmapi.request_arguments``: keywords checked against
``SamplingParams`` and ``generate_async`` as read from TensorRT-LLM's source, ``data/llmapi_args.json``) and
what it makes of the API's answers (``forge_llmapi.LLMAnswer``, over stand-ins with the fields and the
log-prob layout that source describes, ``token_level`` there). That the LLM API answers so on a GPU is not run
here. Then the generated ``config.pbtxt`` (protobuf) and the OpenAI front, which decides by that config.

Bad inputs tried here: token ids outside the vocabulary, log-probs the API leaves out or cuts short, a scored
token missing from its position, log-probs as plain numbers, and token-level requests to a repository whose
model declares none of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from forge import tritonconfig as tc
from forge.cli import main
from forge.in_triton import forge_llmapi

ARGS = json.loads((Path(__file__).parent / "data" / "llmapi_args.json").read_text())
SAMPLING_FIELDS = {f["name"] for f in ARGS["sampling_params"]["fields"]}
GENERATE_ASYNC = {p["name"] for p in ARGS["generate_async"]["parameters"]}
COMPLETION_FIELDS = {f["name"] for f in ARGS["generate_async"]["CompletionOutput"]["fields"]} | set(
    ARGS["generate_async"]["CompletionOutput"]["properties"])
LOGPROB_FIELDS = [f["name"] for f in ARGS["token_level"]["Logprob"]["fields"]]


# -- stand-ins for the LLM API's result classes (tensorrt_llm/executor/result.py, llmapi/llm.py) ---------------

@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    request_perf_metrics: object = None
    last_text_len: int = 0  # result.py's hidden _last_text_len

    @property
    def text_diff(self) -> str:
        return self.text[self.last_text_len:]


@dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list
    finished: bool = False


def test_the_stand_ins_have_the_llm_apis_field_names():
    assert LOGPROB_FIELDS == ["logprob", "rank"]
    read = {"index", "text", "token_ids", "cumulative_logprob", "logprobs", "prompt_logprobs", "finish_reason",
            "stop_reason", "request_perf_metrics", "text_diff"}
    assert read <= COMPLETION_FIELDS
    assert {"prompt_token_ids", "outputs", "finished"} <= set(ARGS["generate_async"]["RequestOutput_attributes"])


def token_text(token: int) -> str:
    return f"<{token}>"


def strings(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def parse(**tensors) -> forge_llmapi.LLMRequest:
    base = {"text_input": strings("")}
    base.update({k: v if isinstance(v, np.ndarray) else np.array([v]) for k, v in tensors.items()})
    return forge_llmapi.parse(base, decoupled=True)


# -- what model.py hands the LLM API ----------------------------------------------------------------------------

def test_token_level_inputs_become_the_llm_apis_prompt_and_sampling_keywords():
    parsed = parse(prompt_token_ids=np.array([5, 6, 7], np.int32), sampling_param_logprobs=np.array([2], np.int32),
                   sampling_param_prompt_logprobs=np.array([0], np.int32), sampling_param_ignore_eos=np.array([True]),
                   sampling_param_min_tokens=np.array([3], np.int32),
                   sampling_param_repetition_penalty=np.array([1.2], np.float32))
    call = forge_llmapi.request_arguments(parsed, "/tmp")
    assert call["inputs"] == {"prompt_token_ids": [5, 6, 7]}  # the LLM API's TokensPrompt
    assert call["sampling"] == {"logprobs": 2, "prompt_logprobs": 0, "ignore_eos": True, "min_tokens": 3,
                                "repetition_penalty": pytest.approx(1.2), "exclude_input_from_output": True}
    assert set(call["sampling"]) <= SAMPLING_FIELDS  # SamplingParams is keyword-only: a wrong name is a TypeError
    # a salt of its own, so no cached prefix hides the context logits its prompt log-probs come from
    assert set(call["options"]) == {"cache_salt"} <= GENERATE_ASYNC
    assert call["options"]["cache_salt"] != forge_llmapi.request_arguments(parsed, "/tmp")["options"]["cache_salt"]


def test_a_text_prompt_keeps_the_kv_cache_and_model_py_echoes_the_prompt_itself():
    parsed = forge_llmapi.parse({"text_input": strings("Hello"), "sampling_param_logprobs": np.array([1], np.int32)},
                                decoupled=False)
    call = forge_llmapi.request_arguments(parsed, "/tmp")
    assert call["inputs"] == "Hello" and call["options"] == {} and parsed.echo
    # the LLM's outputs stay the generated tokens (the log-probs are read beside them); model.py adds the echo
    assert call["sampling"]["exclude_input_from_output"] is True


def test_the_served_model_passes_the_extra_keywords_to_generate_async():
    from forge import in_triton as served

    text = served.LLMAPI_MODEL.read_text()
    assert '**call["options"]' in text and "forge_llmapi.LLMAnswer(" in text
    assert "forge_llmapi.check_token_ids(" in text


@pytest.mark.parametrize("ids, vocab, words", [
    ([1, 50], 50, "token id 50 is outside the vocabulary [0, 50)"),
    ([-1], None, "token id -1 is outside the vocabulary"),
])
def test_token_ids_outside_the_vocabulary_are_refused(ids, vocab, words):
    with pytest.raises(forge_llmapi.RequestError, match=words.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        forge_llmapi.check_token_ids(ids, vocab)
    forge_llmapi.check_token_ids([0, 49], 50)


def test_the_vocabulary_comes_from_the_checkpoint(tiny_gpt2, tmp_path):
    config = json.loads((tiny_gpt2 / "config.json").read_text())
    assert forge_llmapi.checkpoint_vocab_size(str(tiny_gpt2)) == config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 32064}}))
    assert forge_llmapi.checkpoint_vocab_size(str(tmp_path)) == 32064
    assert forge_llmapi.checkpoint_vocab_size(str(tmp_path / "missing")) is None


# -- what model.py makes of the LLM API's answers -----------------------------------------------------------------

def answer(parsed: forge_llmapi.LLMRequest, output: RequestOutput, final: bool = True,
           state: forge_llmapi.LLMAnswer | None = None):
    state = state or forge_llmapi.LLMAnswer(parsed, token_text)
    result = state.completion(output, final)
    configured = {name: np.dtype(object) if kind == "STRING" else np.dtype(kind.lower())
                  for name, kind, _ in forge_llmapi.EXTENSION_OUTPUTS}
    configured["text_output"] = np.dtype(object)
    return result, forge_llmapi.outputs(result, parsed, configured)


def test_log_probs_come_back_in_the_python_targets_json_shape():
    """Chosen (or prompt) token first, then the alternatives by rank; the prompt's lead with null."""
    parsed = parse(prompt_token_ids=np.array([5, 6, 7], np.int32), sampling_param_logprobs=np.array([1], np.int32),
                   sampling_param_prompt_logprobs=np.array([1], np.int32), return_num_input_tokens=np.array([True]),
                   return_num_output_tokens=np.array([True]), sampling_param_exclude_input_from_output=np.array([True]))
    completion = CompletionOutput(
        text="ab", token_ids=[9, 4], finish_reason="length",
        # the sampled 9 is outside the top 1 (rank 3): top-1 and it; 4 is the top-1 itself
        logprobs=[{3: Logprob(-0.5, 1), 9: Logprob(-2.0, 3)}, {4: Logprob(-0.1, 1)}],
        # entry i scores prompt token i + 1; the last one scores the first generated token
        prompt_logprobs=[{6: Logprob(-1.5, 2), 8: Logprob(-0.7, 1)}, {7: Logprob(-0.3, 1)}, {9: Logprob(-2.0, 3),
                                                                                            3: Logprob(-0.5, 1)}])
    result, tensors = answer(parsed, RequestOutput([5, 6, 7], [completion], finished=True))
    assert result.text == "ab" and result.tokens == (3, 2) and result.finish_reason == "length"
    generated = json.loads(tensors["logprobs"][0])
    assert generated == [{"9": {"logprob": -2.0, "rank": 3, "decoded_token": "<9>"},
                          "3": {"logprob": -0.5, "rank": 1, "decoded_token": "<3>"}},
                         {"4": {"logprob": -0.1, "rank": 1, "decoded_token": "<4>"}}]
    assert [list(p) for p in generated] == [["9", "3"], ["4"]]  # the chosen token first
    prompt = json.loads(tensors["prompt_logprobs"][0])
    assert prompt[0] is None and len(prompt) == 3 and [next(iter(p)) for p in prompt[1:]] == ["6", "7"]
    assert tensors["num_input_tokens"].tolist() == [3] and tensors["num_output_tokens"].tolist() == [2]

    from forge.openai_front import logprobs  # the OpenAI front reads what the model wrote

    scored = logprobs.parse(tensors["logprobs"][0].decode(), 1)
    assert [(s.token.id, s.token.rank, [a.id for a in s.alternatives]) for s in scored] == [(9, 3, [3]), (4, 1, [4])]


def test_a_token_id_prompt_is_echoed_as_the_text_model_py_decoded():
    parsed = parse(prompt_token_ids=np.array([5, 6], np.int32))
    parsed.prompt = "<5><6>"  # model.py decodes the ids with the LLM's tokenizer when the echo needs them
    result, _ = answer(parsed, RequestOutput([5, 6], [CompletionOutput(text=" x", token_ids=[1])], True))
    assert result.text == "<5><6> x"


def test_streamed_responses_carry_each_tokens_log_probs_once_and_the_prompts_first():
    parsed = parse(prompt_token_ids=np.array([5, 6], np.int32), sampling_param_logprobs=np.array([0], np.int32),
                   sampling_param_prompt_logprobs=np.array([0], np.int32), streaming=np.array([True]),
                   sampling_param_exclude_input_from_output=np.array([True]))
    state = forge_llmapi.LLMAnswer(parsed, token_text)
    prompt = [{6: Logprob(-1.0, 2)}, {8: Logprob(-0.2, 1)}]
    step = CompletionOutput(text="a", token_ids=[8], logprobs=[{8: Logprob(-0.2, 1)}], prompt_logprobs=prompt)
    first, tensors = answer(parsed, RequestOutput([5, 6], [step]), final=False, state=state)
    assert [list(p) for p in first.logprobs] == [["8"]] and len(first.prompt_logprobs) == 2
    # the next step: cumulative token_ids / logprobs, prompt log-probs kept on the output (cached upstream)
    step.last_text_len, step.text, step.token_ids = 1, "ab", [8, 2]
    step.logprobs = step.logprobs + [{2: Logprob(-0.4, 1)}]
    second, tensors = answer(parsed, RequestOutput([5, 6], [step], finished=True), final=True, state=state)
    assert second.text == "b" and [list(p) for p in second.logprobs] == [["2"]]
    assert second.prompt_logprobs is None and "prompt_logprobs" not in tensors
    # a response that brings no new log-probs repeats none
    assert state.completion(RequestOutput([5, 6], [step], finished=True), True).logprobs == []


def test_stop_sequence_tokens_cut_from_token_ids_take_their_log_probs_along():
    parsed = parse(prompt_token_ids=np.array([5], np.int32), sampling_param_logprobs=np.array([0], np.int32))
    completion = CompletionOutput(text="a", token_ids=[8], finish_reason="stop",
                                  logprobs=[{8: Logprob(-0.2, 1)}, {3: Logprob(-0.1, 1)}])
    result, _ = answer(parsed, RequestOutput([5], [completion], True))
    assert [list(p) for p in result.logprobs] == [["8"]]


@pytest.mark.parametrize("completion, words", [
    (CompletionOutput(token_ids=[8, 9]), "returned no log-probs for the 2 generated tokens"),
    (CompletionOutput(token_ids=[8], logprobs=[{3: Logprob(-0.1, 1)}]), "leave out token 8"),
    (CompletionOutput(token_ids=[8], logprobs=[-0.2]), "as float, not as a dict"),
    (CompletionOutput(token_ids=[8], logprobs=[{8: Logprob(-0.2)}]), "carry no rank"),
    (CompletionOutput(token_ids=[8], logprobs=[{8: Logprob(-0.2, 1)}]), "returned no prompt log-probs"),
    (CompletionOutput(token_ids=[8], logprobs=[{8: Logprob(-0.2, 1)}], prompt_logprobs=[{6: Logprob(-1.0, 1)}]),
     "prompt log-probs for 1 of the prompt's 3 tokens"),
])
def test_log_probs_the_llm_api_leaves_out_fail_the_request_instead_of_coming_back_empty(completion, words):
    parsed = parse(prompt_token_ids=np.array([5, 6, 7], np.int32), sampling_param_logprobs=np.array([0], np.int32),
                   sampling_param_prompt_logprobs=np.array([0], np.int32))
    with pytest.raises(RuntimeError, match=words):
        forge_llmapi.LLMAnswer(parsed, token_text).completion(RequestOutput([5, 6, 7], [completion], True), True)


# -- config.pbtxt and the OpenAI front ----------------------------------------------------------------------------

def test_the_config_declares_the_token_level_tensors(tiny_gpt2, tmp_path):
    out = tmp_path / "repo"
    assert main(["build", "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out)]) == 0
    config = tc.read(out / "tensorrt_llm")  # protobuf-parsed config.pbtxt
    assert tc.parameter(config, "forge_target") == "tensorrtllm"
    inputs = {t.name: (tc.dtype_name(t.data_type), list(t.dims), t.optional) for t in config.input}
    outputs = {t.name: (tc.dtype_name(t.data_type), list(t.dims)) for t in config.output}
    assert inputs["prompt_token_ids"] == ("INT32", [-1], True)
    assert inputs["sampling_param_logprobs"] == inputs["sampling_param_prompt_logprobs"] == ("INT32", [1], True)
    assert inputs["sampling_param_ignore_eos"] == ("BOOL", [1], True)
    assert inputs["return_num_output_tokens"] == ("BOOL", [1], True)
    assert outputs["logprobs"] == outputs["prompt_logprobs"] == ("STRING", [-1])
    assert outputs["num_input_tokens"] == outputs["num_output_tokens"] == ("INT32", [1])


def test_the_openai_front_sends_token_level_requests_by_the_models_declared_tensors(tiny_gpt2, tmp_path):
    from forge.openai_front import catalog, translate
    from forge.openai_front.protocol import APIError

    asked = translate.Generation("", 4, prompt_ids=[1, 2, 3], logprobs=2, prompt_logprobs=1)
    out = tmp_path / "llmapi"
    assert main(["build", "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(out)]) == 0
    tensors = translate.tensors(catalog.load(out).generator, asked, stream=False)
    assert tensors["prompt_token_ids"].tolist() == [1, 2, 3] and tensors["text_input"].tolist() == [b""]
    assert tensors["sampling_param_logprobs"].tolist() == [2]
    assert tensors["sampling_param_prompt_logprobs"].tolist() == [1]
    # the engine layout's ensemble declares none of it: refused with a 400 naming the parameter
    engine = tmp_path / "engine"
    assert main(["build", "--family", "gpt", "--model", str(tiny_gpt2), "--out", str(engine), "--target", "python",
                 "--dtype", "float32", "--backend-version", "1.2.1"]) == 0
    with pytest.raises(APIError, match="takes text and answers text only") as err:
        translate.tensors(catalog.load(engine).generator, asked, stream=False)
    assert err.value.status == 400
