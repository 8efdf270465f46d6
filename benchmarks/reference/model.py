"""The reference server model the serving benchmark compares against (seed 000's baseline).

A Triton python-backend model that runs the Hugging Face ``text-generation`` pipeline once per
request: ``text_input`` + ``max_tokens`` → ``text_output`` (the generated text only), greedy. This is
how a model is usually put behind Triton without an inference engine: requests that Triton batches
together are still generated one after another.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import torch
        from transformers import pipeline

        config = json.loads(args["model_config"])
        model_dir = config["parameters"]["model_dir"]["string_value"]
        parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
        threads = int(parameters.get("cpu_threads") or 0)
        dtype = getattr(torch, parameters.get("dtype") or "float32")
        if threads > 0:
            torch.set_num_threads(threads)
        device = 0 if torch.cuda.is_available() else -1
        self.pipe = pipeline("text-generation", model=model_dir, device=device, dtype=dtype)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
                prompt = prompt.decode() if isinstance(prompt, bytes) else str(prompt)
                max_tokens = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
                out = self.pipe(prompt, max_new_tokens=max_tokens, do_sample=False, return_full_text=False)
                text = np.array([[out[0]["generated_text"].encode()]], dtype=np.object_)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
            except Exception as exc:  # one bad request must not fail the others
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
        return responses
