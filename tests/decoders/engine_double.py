"""Test doubles of the TensorRT-LLM engine — and only of the engine.

``write_engine_dir`` writes what ``trtllm-build`` leaves behind (config.json + rank files) with
placeholder bytes instead of TensorRT plans, so repository emission can be tested without a GPU.
``generating_model`` is a python-backend stand-in for the C++ ``tensorrt_llm`` model: same tensor
interface, but it "generates" a fixed continuation text, so the real preprocessing, postprocessing,
BLS and ensemble can be exercised on tritonserver.
"""

from __future__ import annotations

import json
from pathlib import Path

FAKE_ENGINE_BYTES = b"forge test double: not a TensorRT engine\n"


def write_engine_dir(path: Path, *, tp: int = 1, pp: int = 1, vocab_size: int = 420,
                     dtype: str = "float16", logits_dtype: str = "float32") -> Path:
    """An engine directory shaped like trtllm-build's output, for tests only."""
    path.mkdir(parents=True, exist_ok=True)
    world = tp * pp
    (path / "config.json").write_text(json.dumps({
        "version": "test-double",
        "pretrained_config": {"architecture": "GPT2LMHeadModel", "dtype": dtype, "logits_dtype": logits_dtype,
                              "vocab_size": vocab_size,
                              "mapping": {"world_size": world, "tp_size": tp, "pp_size": pp}},
        "build_config": {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048}}))
    for rank in range(world):
        (path / f"rank{rank}.engine").write_bytes(FAKE_ENGINE_BYTES)
    (path / "trtllm-build.log").write_text("not part of the repository\n")
    return path


GENERATING_MODEL = '''
"""Test double of the C++ tensorrt_llm model: continues every prompt with a fixed text."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"], local_files_only=True)
        self.continuation = tokenizer.encode(params["continuation"], add_special_tokens=False)
        self.end_id = tokenizer.eos_token_id
        self.decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
        self.seen = []

    def _input(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = self._input(request, "input_ids")
            lengths = self._input(request, "input_lengths").reshape(-1)
            wanted = int(self._input(request, "request_output_len").reshape(-1)[0])
            streaming = self._input(request, "streaming")
            streaming = bool(streaming is not None and streaming.reshape(-1)[0])
            stop = self._input(request, "stop_words_list")
            end_id = self._input(request, "end_id")
            self.seen.append({"streaming": streaming, "has_stop_words": stop is not None,
                              "end_id": None if end_id is None else int(end_id.reshape(-1)[0])})
            generated = self.continuation[:wanted]
            if not self.decoupled:
                rows = [list(ids[b, :lengths[b]]) + generated for b in range(ids.shape[0])]
                width = max(len(r) for r in rows)
                out = np.full((len(rows), 1, width), self.end_id, dtype=np.int32)
                for b, row in enumerate(rows):
                    out[b, 0, :len(row)] = row
                seq = np.array([[len(r)] for r in rows], dtype=np.int32)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", out),
                                                             pb_utils.Tensor("sequence_length", seq)]))
                continue
            sender = request.get_response_sender()
            if streaming:
                for token in generated:
                    sender.send(pb_utils.InferenceResponse([
                        pb_utils.Tensor("output_ids", np.array([[[token]]], dtype=np.int32)),
                        pb_utils.Tensor("sequence_length", np.array([[1]], dtype=np.int32))]))
            else:
                row = list(ids[0, :lengths[0]]) + generated
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("output_ids", np.array([[row]], dtype=np.int32)),
                    pb_utils.Tensor("sequence_length", np.array([[len(row)]], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None if self.decoupled else responses
'''


def generating_model(name: str, profile, spec, tokenizer_dir: Path, continuation: str, decoupled: bool):
    """A TritonModel standing in for the C++ tensorrt_llm model (same interface, fixed output text)."""
    from forge import tritonconfig as tc
    from forge.components import TritonModel
    from forge.llm.interface import tensorrt_llm_io

    inputs, outputs = tensorrt_llm_io(profile, spec)
    config = tc.model_config(name, backend="python", max_batch_size=spec.limits.max_batch_size,
                             inputs=inputs, outputs=outputs, instances=1, decoupled=decoupled,
                             parameters={"tokenizer_dir": str(tokenizer_dir), "continuation": continuation})
    return TritonModel(config, {"1/model.py": GENERATING_MODEL})
