"""forge's ``postprocessing`` model: token ids → text, safe for streaming.

Runs in Triton's python backend (copied into a repository as ``postprocessing/1/model.py``).
It decodes each beam's ``sequence_length`` tokens like the tokenizer does, unless the repository's
tensorrt_llm model is decoupled (``streaming`` parameter): then a response may hold only the tokens
generated since the previous one, and the model returns exactly the bytes those tokens add after
the text before them. Spaces that SentencePiece keeps inside tokens ("▁Paris") are not lost and the
pieces concatenate to the full text. Every piece is valid UTF-8, as tensorrtllm_backend's own
postprocessing makes it (its clients call ``text_output[0].decode()`` on each): a character whose bytes
span two streamed tokens arrives as U+FFFD in each piece, exactly as there. The BLS model
(``-o bls=true``) keeps per-request state and streams such characters whole. A response that starts
with the tokenizer's BOS token holds a whole sequence and is decoded normally.

``OUTPUT`` is one text per beam of every row, flattened to ``[batch * beams]`` whatever rank the
config declares: the shape tensorrtllm_backend's own postprocessing returns (every release), which
its clients index as ``text_output[0].decode()``.

Inputs ``X`` with a declared output ``OUT_X`` (log probs, logits, batch index in older backend
versions) are passed through unchanged.
"""

import os
import sys

# Text work only: one OpenMP thread, so this process never competes with the decoder for cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forge_glue  # noqa: E402  (shipped next to this file)
import forge_text  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        config, params, self.tokenizer = forge_text.model_setup(args)
        self.skip_special_tokens = forge_text.parse_bool(params.get("skip_special_tokens"), True)
        self.codec = forge_text.TokenBytes(self.tokenizer, self.skip_special_tokens)
        self.bos_id = self.tokenizer.bos_token_id
        self.streaming = forge_text.parse_bool(params.get("streaming"), False)
        self.inputs = {t["name"] for t in config["input"]}
        outputs = {t["name"]: t for t in config["output"]}
        self.passthrough = [(name[len("OUT_"):], name) for name in outputs
                            if name.startswith("OUT_") and name[len("OUT_"):] in self.inputs]

    def execute(self, requests):
        return forge_glue.run_each(requests, self._process)

    def _get(self, request, name):
        return forge_glue.get(request, name, self.inputs)

    def _text(self, ids):
        whole = len(ids) > 0 and self.bos_id is not None and int(ids[0]) == self.bos_id
        if not self.streaming or whole:
            return forge_text.decode(self.tokenizer, ids, self.skip_special_tokens).encode("utf-8")
        # Valid UTF-8 like the backend's own postprocessing (its clients decode every piece): bytes of a
        # character that the previous or next token completes become U+FFFD; the BLS model keeps them whole.
        return self.codec.bytes_of(ids, at_start=False).decode("utf-8", errors="replace").encode("utf-8")

    def _process(self, request):
        tokens = self._get(request, "TOKENS_BATCH")
        if tokens.ndim == 2:  # [batch, seq] from a model without a beam dimension
            tokens = tokens[:, None, :]
        batch, beams = tokens.shape[0], tokens.shape[1]
        lengths = self._get(request, "SEQUENCE_LENGTH")
        lengths = np.full((batch, beams), tokens.shape[2]) if lengths is None else lengths.reshape(batch, -1)
        texts = np.empty((batch, beams), dtype=object)
        for b in range(batch):
            for beam in range(beams):
                length = int(min(max(lengths[b, min(beam, lengths.shape[1] - 1)], 0), tokens.shape[2]))
                texts[b, beam] = self._text(tokens[b, beam, :length].tolist())
        out = [pb_utils.Tensor("OUTPUT", texts.reshape(-1))]
        for source, target in self.passthrough:
            value = self._get(request, source)
            if value is not None:
                out.append(pb_utils.Tensor(target, value))
        return out
