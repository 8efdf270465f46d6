"""The OpenAI front on a vLLM-backend model: its sampling settings as the one ``sampling_parameters`` JSON."""

from __future__ import annotations

import json

from forge.clients.inference import ModelInputs, is_text_generator
from forge.openai_front import translate as rq
from forge.openai_front.catalog import TextModel
from forge.openai_front.vllm_interface import fold, with_virtual_inputs

VLLM_CONFIG = {"name": "ensemble", "backend": "vllm", "model_transaction_policy": {"decoupled": True},
               "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
                         {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1]},
                         {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1]},
                         {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1]},
                         {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": [1]},
                         {"name": "return_num_input_tokens", "data_type": "TYPE_BOOL", "dims": [1]},
                         {"name": "return_logprobs", "data_type": "TYPE_BOOL", "dims": [1]},
                         {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": [1]}],
               "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
                          {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]}]}


def _model() -> TextModel:
    return TextModel(with_virtual_inputs(ModelInputs.from_config(VLLM_CONFIG)))


def test_a_vllm_backend_model_is_a_text_generator_with_virtual_inputs():
    assert is_text_generator(ModelInputs.from_config(VLLM_CONFIG))
    assert {"sampling_param_max_tokens", "sampling_param_stop", "sampling_param_seed"} <= set(_model().inputs.inputs)


def test_the_request_is_sent_as_text_flags_and_one_sampling_json():
    generation = rq.Generation("Hello", max_tokens=7, stops=["\n"],
                               sampling={"sampling_param_top_k": 1, "sampling_param_seed": 5})
    tensors = rq.tensors(_model(), generation, stream=False)
    assert set(tensors) == {"text_input", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
                            "return_num_input_tokens", "return_num_output_tokens"}
    sent = json.loads(tensors["sampling_parameters"][0])
    assert sent == {"max_tokens": 7, "stop": ["\n"], "seed": 5, "temperature": 0}  # greedy as vLLM's greedy
    streamed = rq.tensors(_model(), generation, stream=True)
    assert bool(streamed["stream"][0]) and "return_num_output_tokens" not in streamed  # counted per response


def test_log_probs_and_a_json_schema_become_vllms_logprobs_and_structured_outputs():
    schema = json.dumps({"type": "object"})
    generation = rq.Generation("Hello", max_tokens=3, logprobs=2, guide=("json_schema", schema))
    tensors = rq.tensors(_model(), generation, stream=True)
    assert bool(tensors["return_logprobs"][0]) and "guided_decoding_guide" not in tensors
    sent = json.loads(tensors["sampling_parameters"][0])
    assert sent["logprobs"] == 2 and json.loads(sent["structured_outputs"]) == {"json": schema}
    assert "return_logprobs" not in rq.tensors(_model(), rq.Generation("Hello", max_tokens=3), stream=False)


def test_each_guide_type_goes_as_its_structured_outputs_field_and_an_unknown_one_is_a_400():
    import pytest

    from forge.openai_front.protocol import APIError

    for kind, field in (("regex", "regex"), ("ebnf_grammar", "grammar"), ("json", "json")):
        tensors = rq.tensors(_model(), rq.Generation("Hi", max_tokens=3, guide=(kind, "x")), stream=False)
        assert json.loads(json.loads(tensors["sampling_parameters"][0])["structured_outputs"]) == {field: "x"}
    with pytest.raises(APIError, match="'lark'") as err:
        rq.tensors(_model(), rq.Generation("Hi", max_tokens=3, guide=("lark", "x")), stream=False)
    assert err.value.status == 400


def test_what_the_vllm_backend_cannot_answer_is_a_400_naming_it():
    import pytest

    from forge.openai_front.protocol import APIError

    for generation, param in ((rq.Generation("Hi", max_tokens=1, prompt_logprobs=1), "echo"),
                              (rq.Generation("", max_tokens=1, prompt_ids=[1, 2]), "prompt")):
        with pytest.raises(APIError, match="Triton's vLLM backend") as err:
            rq.tensors(_model(), generation, stream=False)
        assert err.value.status == 400 and err.value.param == param


def test_other_models_pass_unchanged():
    config = {"name": "m", "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
                                     {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1]}]}
    inputs = ModelInputs.from_config(config)
    assert with_virtual_inputs(inputs) is inputs
    assert fold(inputs, {"text_input": "x", "max_tokens": 3}, stream=False) == {"text_input": "x", "max_tokens": 3}


def test_the_fronts_scheduler_figures_count_what_vllm_reports():
    from forge.openai_front.scheduler_stats import figures

    text = ('nv_inference_pending_request_count{model="ensemble",version="1"} 1\n'
            'vllm:num_requests_waiting{model="ensemble",version="1"} 3\n'
            'vllm:num_requests_running{model="ensemble",version="1"} 5\n'
            'vllm:num_requests_running{model="other",version="1"} 7\n')
    assert figures(text, {"ensemble"}) == (4.0, 5.0)
    assert figures('nv_inference_pending_request_count{model="ensemble",version="1"} 2\n', {"ensemble"}) == (2.0, None)
