"""forge's ``hf-pipeline`` model: the plain baseline, the Hugging Face ``text-generation`` pipeline per request.

Runs in Triton's python backend (copied into a repository as ``<prefix>ensemble/1/model.py``, so the
generate endpoint, ``forge infer`` and ``forge bench`` reach it where they reach a decoder's ensemble).
It is how a model is put behind Triton without an inference engine: no dynamic batching
(``max_batch_size`` 0), one instance, torch's default threads unless ``-o cpu_threads`` says otherwise;
requests are generated one after another, greedy. Inputs: ``text_input`` and ``max_tokens``;
``exclude_input_in_output`` drops the prompt from ``text_output``; ``bad_words`` / ``stop_words`` are
accepted only empty (the tensorrtllm_backend README's curl sends ``""``): a pipeline has no word lists, and a non-empty one
is a per-request error, never ignored.
"""

import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forge_glue  # noqa: E402  (shipped next to this file)


class TritonPythonModel:
    def initialize(self, args):
        params = forge_glue.parameters(forge_glue.model_config(args))
        weights = os.path.join(os.path.dirname(os.path.abspath(__file__)), params.get("weights") or "hf")
        forge_glue.skip_vision_libraries(weights)
        import torch
        from transformers import pipeline

        threads = int(params.get("cpu_threads") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        device = params.get("device") or "auto"
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.pipe = pipeline("text-generation", model=weights, device=device,
                             dtype=getattr(torch, params.get("dtype") or "float16"))
        pb_utils.Logger.log_info(f"forge hf-pipeline: {weights} on {device} ({params.get('dtype')}), "
                                 f"{torch.get_num_threads()} torch threads")

    def execute(self, requests):
        return forge_glue.run_each(requests, self._process)

    def _process(self, request):
        prompt = forge_glue.get(request, "text_input").reshape(-1)[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        max_tokens = int(forge_glue.get(request, "max_tokens").reshape(-1)[0])
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        for name in ("bad_words", "stop_words"):
            words = forge_glue.get(request, name)
            if words is not None and any(w for w in words.reshape(-1).tolist()):
                raise ValueError(f"{name} is not supported by the hf-pipeline target (send it empty)")
        exclude = forge_glue.get(request, "exclude_input_in_output")
        full = exclude is None or not bool(exclude.reshape(-1)[0])
        out = self.pipe(prompt, max_new_tokens=max_tokens, do_sample=False, return_full_text=full)
        return {"text_output": np.array([out[0]["generated_text"].encode("utf-8")], dtype=object)}
