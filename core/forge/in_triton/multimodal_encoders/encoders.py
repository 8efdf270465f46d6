"""Triton python-backend model ``multimodal_encoders``: encoded images → the decoder's prompt table.

Input ``IMAGE`` (STRING/BYTES: the file's bytes — PNG, JPEG, …, or their base64 text as the generate
endpoint sends them — one per request, optional) and ``QUERY`` (the prompt, only so that Triton runs this
step for text-only requests too). Outputs ``OUT_PROMPT_EMBEDDING_TABLE`` ([visual tokens, hidden] per
request) and ``OUT_PROMPT_VOCAB_SIZE`` (its number of rows), the tensors tensorrtllm_backend's multimodal
ensemble hands to ``tensorrt_llm``, and ``OUT_PROMPT_TABLE_EXTRA_ID`` (a hash of the image bytes: the key
of its KV-cache blocks). A request without an image gets none of them: the ensemble then leaves the
optional inputs they feed unset, so the same ensemble serves text-only prompts as a text model would.
The images of one batch are preprocessed (the model's own image-processor recipe, ``forge_image.py``) and
encoded in one run: ONNX Runtime over the exported vision graph (python target) or the TensorRT plan
that ``trtexec`` built (tensorrtllm target, on a GPU). A bad image fails its own request only.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import sys

import numpy as np

try:  # the build and tests import this module as part of forge.in_triton
    from .. import forge_glue
    from ..encoder_models import image as forge_image, onnx_encoder as forge_onnx
except ImportError:  # inside a repository they sit next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import forge_glue
    import forge_image
    import forge_onnx

TABLE, ROWS, EXTRA_ID = "OUT_PROMPT_EMBEDDING_TABLE", "OUT_PROMPT_VOCAB_SIZE", "OUT_PROMPT_TABLE_EXTRA_ID"


class OnnxVision:
    """The vision graph run by ONNX Runtime."""

    def __init__(self, path: str, params: dict):
        self.encoder = forge_onnx.OnnxEncoder(path, device=params.get("device", "auto"),
                                              intra_op_threads=int(params.get("intra_op_threads", "0") or 0))

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        return self.encoder.run({self.encoder.inputs[0]: pixels})


class TensorRTVision:
    """The vision plan run by TensorRT on the model instance's GPU (tensorrtllm target; needs tensorrt + torch)."""

    def __init__(self, path: str, params: dict):
        import tensorrt as trt
        import torch

        self.torch = torch
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        with open(path, "rb") as fh:
            self.engine = runtime.deserialize_cuda_engine(fh.read())
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input = next(n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT)
        self.output = next(n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        torch = self.torch
        x = torch.from_numpy(np.ascontiguousarray(pixels)).cuda()
        self.context.set_input_shape(self.input, tuple(x.shape))
        y = torch.empty(tuple(self.context.get_tensor_shape(self.output)), dtype=torch.float32, device="cuda")
        self.context.set_tensor_address(self.input, x.data_ptr())
        self.context.set_tensor_address(self.output, y.data_ptr())
        stream = torch.cuda.current_stream()
        self.context.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        return y.cpu().numpy()


RUNTIMES = {"onnxruntime": OnnxVision, "tensorrt": TensorRTVision}


class TritonPythonModel:
    def initialize(self, args):
        config = forge_glue.model_config(args)
        params = forge_glue.parameters(config)
        here = os.path.join(args["model_repository"], args["model_version"])
        self.preprocess = forge_image.from_parameters(params)
        self.vision = RUNTIMES[params.get("runtime", "onnxruntime")](os.path.join(here, params["model_file"]), params)
        self.rows = int(params["visual_tokens"])
        self.max_batch = max(1, int(config.get("max_batch_size") or 1))
        self.dtype = next(np.dtype(forge_glue.pb_utils.triton_string_to_numpy(o["data_type"]))
                          for o in config["output"] if o["name"] == TABLE)

    def execute(self, requests):
        pixels, errors, owners, images = [], {}, [], {}
        for index, request in enumerate(requests):
            try:
                data = self._image(request)
                if data is not None:
                    pixels.append(self.preprocess(data))
                    owners.append(index)
                    images[index] = data
            except ValueError as exc:
                errors[index] = exc
        features = {}
        for start in range(0, len(pixels), self.max_batch):  # the plan's profile ends at the max batch
            batch = np.stack(pixels[start:start + self.max_batch]).astype(np.float32)
            try:
                out = self.vision(batch)
            except Exception as exc:  # noqa: BLE001 - the requests of this batch get the error
                errors.update({owners[start + i]: exc for i in range(len(batch))})
                continue
            features.update({owners[start + i]: out[i] for i in range(len(batch))})
        responses = []
        for index, request in enumerate(requests):
            if index in errors:
                responses.append(forge_glue.error_response(errors[index], "image"))
                continue
            if index not in features:  # text-only: no table at all (see the module docstring)
                responses.append(forge_glue.response(request, {}))
                continue
            table = features[index]
            responses.append(forge_glue.response(request, {
                TABLE: np.ascontiguousarray(table[None], dtype=self.dtype),
                ROWS: np.array([[table.shape[0]]], dtype=np.int32),
                EXTRA_ID: np.array([[image_key(images[index])]], dtype=np.uint64)}))
        return responses

    def _image(self, request):
        """The request's image bytes (None: a text-only request)."""
        raw = forge_glue.get(request, "IMAGE")
        if raw is None or raw.size == 0:
            return None
        if raw.size != 1:
            raise ValueError(f"send one image per request (got {raw.size})")
        data = raw.reshape(-1)[0]
        data = data if isinstance(data, bytes) else str(data).encode()
        return from_base64(data)  # empty bytes are a bad image (an error), not a text-only request


def image_key(data: bytes) -> int:
    """The image's ``prompt_table_extra_id``: a 63-bit hash of its bytes, never 0 (0 means "no image")."""
    return (int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1) or 1


def from_base64(data: bytes) -> bytes:
    """The image bytes of ``data``: the generate endpoint sends BYTES as JSON strings, so images arrive base64-encoded
    there; binary image files (PNG, JPEG, …) are never valid base64 as a whole and pass unchanged."""
    try:
        return base64.b64decode(data.strip(), validate=True) if data.strip() else data
    except (binascii.Error, ValueError):
        return data
