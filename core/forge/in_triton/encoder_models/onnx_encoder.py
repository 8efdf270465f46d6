"""Triton python-backend model: an encoder tower run by ONNX Runtime inside the server.

This is forge's ``python`` target for encoders (the embedded tritonserver of ``nvidia-pytriton`` has
only the python backend). It serves the same tensors as the ``onnxruntime_onnx`` and
``tensorrt_plan`` models of the other targets. Requests of a dynamic batch may differ in sequence
length (the inputs allow ragged batches): they are right-padded with zeros — attention mask 0 —
to the longest, run as one batch, and split again.
"""

from __future__ import annotations

import os

import numpy as np

try:  # the build imports this module as part of forge.in_triton
    from .. import forge_glue
except ImportError:  # inside a repository it sits next to forge_glue.py
    import forge_glue


def providers_for(device: str, device_id: int = 0) -> list:
    """ONNX Runtime execution providers for ``auto``, ``cpu`` or ``gpu``."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in available:
        return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    if device == "gpu":
        raise RuntimeError("device=gpu, but this onnxruntime has no CUDAExecutionProvider "
                           "(install onnxruntime-gpu, or build with -o device=auto)")
    return ["CPUExecutionProvider"]


class OnnxEncoder:
    """One ONNX Runtime session with ragged-batch merging."""

    def __init__(self, model_file: str, *, device: str = "auto", intra_op_threads: int = 0, device_id: int = 0):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(model_file, options, providers=providers_for(device, device_id))
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.output = self.session.get_outputs()[0].name

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run([self.output], feeds)[0]

    def run_many(self, requests: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
        """Run several requests as one batch; returns one output array per request."""
        sizes = [len(next(iter(feeds.values()))) for feeds in requests]
        merged = {name: merge([feeds[name] for feeds in requests]) for name in self.inputs}
        result = self.run(merged)
        return np.split(result, np.cumsum(sizes)[:-1])


def merge(arrays: list[np.ndarray]) -> np.ndarray:
    """Concatenate along the batch axis, right-padding every other axis with zeros to the largest."""
    if len(arrays) == 1:
        return arrays[0]
    shape = np.max([a.shape for a in arrays], axis=0)
    padded = []
    for a in arrays:
        pad = [(0, 0)] + [(0, int(m - s)) for m, s in zip(shape[1:], a.shape[1:])]
        padded.append(np.pad(a, pad) if any(p[1] for p in pad) else a)
    return np.concatenate(padded)


def check_request(feeds: dict[str, np.ndarray]) -> None:
    """Refuse requests with no rows or with inputs of different batch sizes."""
    sizes = {name: a.shape[0] if a.ndim else 0 for name, a in feeds.items()}
    if any(n == 0 for n in sizes.values()):
        raise ValueError("the request holds no rows (empty batch)")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"inputs have different batch sizes: {sizes}")




class TritonPythonModel:
    """Triton's entry point."""

    def initialize(self, args):
        config = forge_glue.model_config(args)
        params = forge_glue.parameters(config)
        directory = os.path.join(args["model_repository"], args["model_version"])
        self.encoder = OnnxEncoder(
            os.path.join(directory, params.get("model_file", "model.onnx")), device=params.get("device", "auto"),
            intra_op_threads=int(params.get("intra_op_threads", "0")),
            device_id=int(args.get("model_instance_device_id", "0") or 0))
        self.output = config["output"][0]["name"]

    def execute(self, requests):
        feeds, errors = [], {}
        for index, request in enumerate(requests):
            try:
                f = {name: forge_glue.get(request, name) for name in self.encoder.inputs}
                check_request(f)
                feeds.append(f)
            except Exception as exc:
                errors[index] = exc
                feeds.append(None)
        valid = [i for i, f in enumerate(feeds) if f is not None]
        outputs = {}
        if valid:
            try:
                outputs = dict(zip(valid, self.encoder.run_many([feeds[i] for i in valid])))
            except Exception:  # isolate the request that broke the batch
                for i in valid:
                    try:
                        outputs[i] = self.encoder.run(feeds[i])
                    except Exception as exc:
                        errors[i] = exc
        responses = []
        for index in range(len(requests)):
            if index in outputs:
                responses.append(forge_glue.response(
                    requests[index], {self.output: np.ascontiguousarray(outputs[index], dtype=np.float32)}))
            else:
                responses.append(forge_glue.error_response(errors[index], "encoder"))
        return responses
