"""forge's ``tensorrt_llm_bls`` model: the ensemble's job as one python model, with real streaming.

Runs in Triton's python backend (copied into a repository as ``tensorrt_llm_bls/1/model.py``). It
calls the ``preprocessing`` and ``tensorrt_llm`` models of the same repository through BLS requests,
routing tensors with the table forge computed for the chosen backend version (``forge_routes``).
Unlike the stateless ensemble it keeps per-request state while streaming, so every streamed
``text_output`` piece is valid UTF-8 and the pieces concatenate to the full text.
"""

import json
import os
import sys

# Text work only: one OpenMP thread, so this process never competes with the decoder for cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forge_glue  # noqa: E402  (shipped next to this file)
import forge_text  # noqa: E402

# Inputs of the real BLS interface that forge's text decoders do not serve.
UNSUPPORTED = ("image_input", "image_bytes_input", "image_url_input", "video_bytes_input")


class RequestError(Exception):
    """A problem with one request; reported to its client, the model keeps serving."""


class TritonPythonModel:
    def initialize(self, args):
        config, params, self.tokenizer = forge_text.model_setup(args)
        self.skip_special_tokens = forge_text.parse_bool(params.get("skip_special_tokens"), True)
        self.codec = forge_text.TokenBytes(self.tokenizer, self.skip_special_tokens)
        self.accumulate = forge_text.parse_bool(params.get("accumulate_tokens"), False)
        self.llm = params.get("tensorrt_llm_model_name") or "tensorrt_llm"
        self.draft = params.get("tensorrt_llm_draft_model_name") or ""
        self.pre = params.get("preprocessing_model_name") or "preprocessing"
        self.routes = json.loads(params["forge_routes"])
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.inputs = {t["name"] for t in config["input"]}
        self.outputs = {t["name"]: pb_utils.triton_string_to_numpy(t["data_type"]) for t in config["output"]}
        if self.decoupled:  # answered through response senders: counted for forge serve (see forge_glue.InFlight)
            forge_glue.in_flight.track()

    # -- Triton entry points ---------------------------------------------------------------
    def execute(self, requests):
        responses = []
        # every request of the batch waits in this process until its final flag is sent
        counted = [forge_glue.in_flight.opened(r.request_id()) if self.decoupled else False for r in requests]
        for request, count in zip(requests, counted):
            sender = request.get_response_sender() if self.decoupled else None
            wanted = forge_glue.requested(request)
            try:
                result, failure = self._serve(request, sender), None
            except RequestError as exc:
                result, failure = None, exc
            except Exception as exc:  # noqa: BLE001 - a decoupled request must still get its final flag
                result, failure = None, RuntimeError(f"tensorrt_llm_bls failed: {type(exc).__name__}: {exc}")
            if sender is not None:
                if failure is not None or result is not None:
                    forge_glue.send(sender, result, wanted=wanted, exc=failure)
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                forge_glue.in_flight.closed(count)
            elif failure is not None:
                responses.append(forge_glue.error_response(failure))
            else:
                responses.append(forge_glue.response(request, result))
        return None if self.decoupled else responses

    # -- one request -----------------------------------------------------------------------
    def _get(self, request, name):
        return forge_glue.get(request, name, self.inputs)

    def _flag(self, request, name):
        value = self._get(request, name)
        return bool(value is not None and np.asarray(value).reshape(-1)[0])

    def _serve(self, request, sender):
        for name in UNSUPPORTED:
            if self._get(request, name) is not None:
                raise RequestError(f"{name} is not supported: this repository serves a text-only decoder")
        draft = self._get(request, "num_draft_tokens")
        if draft is not None and int(np.asarray(draft).reshape(-1)[0]) > 0 and not self.draft:
            raise RequestError("num_draft_tokens needs a draft model, and this repository has none "
                               "(set -o tensorrt_llm_draft_model_name=… when building)")
        stream = self._flag(request, "stream")
        if stream and not self.decoupled:
            raise RequestError("stream=true needs a decoupled model; build with --decoupled")
        pre_outputs = self._preprocess(request)
        llm_request = self._llm_request(request, pre_outputs, stream)
        if stream:
            return self._stream(request, llm_request, sender)
        return self._outputs(self._single(llm_request), None)

    def _single(self, llm_request):
        """The one response of a non-streaming request (a decoupled model sends it, then a final flag)."""
        if not self.decoupled:
            responses = [llm_request.exec()]
        else:  # tensorrt_llm and this model share the transaction policy (forge validate checks it)
            responses = list(llm_request.exec(decoupled=True))
        for response in responses:
            if response.has_error():
                raise RequestError(response.error().message())
        answers = [r for r in responses if pb_utils.get_output_tensor_by_name(r, "output_ids") is not None]
        if not answers:
            raise RequestError(f"{self.llm} finished without returning tokens")
        return answers[-1]

    def _preprocess(self, request):
        inputs = []
        for bls_name, pre_name in self.routes["preprocessing"]:
            value = self._get(request, bls_name)
            if value is not None:
                inputs.append(pb_utils.Tensor(pre_name, value))
        wanted = sorted({pre_out for pre_out, _ in self.routes["links"]})
        response = pb_utils.InferenceRequest(model_name=self.pre, requested_output_names=wanted,
                                             inputs=inputs).exec()
        if response.has_error():
            raise RequestError(response.error().message())
        return {t.name(): t for t in response.output_tensors()}

    def _llm_request(self, request, pre_outputs, stream):
        inputs = []
        for pre_out, llm_in in self.routes["links"]:
            tensor = pre_outputs.get(pre_out)
            if tensor is not None:
                inputs.append(pb_utils.Tensor(llm_in, tensor.as_numpy()))
        batch = inputs[0].as_numpy().shape[0] if inputs else 1
        if stream and batch != 1:
            raise RequestError("streaming requests must have batch size 1")
        for bls_name, llm_in in self.routes["tensorrt_llm"]:
            if llm_in == self.routes.get("stream_input"):
                continue
            value = self._get(request, bls_name)
            if value is not None:
                if value.ndim == 1 and value.size == batch:  # a scalar input reshaped to [] in this config
                    value = value.reshape(batch, 1)
                inputs.append(pb_utils.Tensor(llm_in, value))
        if self.routes.get("stream_input"):
            inputs.append(pb_utils.Tensor(self.routes["stream_input"], np.full((batch, 1), stream, dtype=bool)))
        wanted = ["output_ids", "sequence_length"] + [llm for llm, _ in self.routes["outputs"]]
        return pb_utils.InferenceRequest(model_name=self.llm, requested_output_names=wanted, inputs=inputs)

    def _stream(self, request, llm_request, sender):
        detokenizers = {}
        sent_any = False
        for response in llm_request.exec(decoupled=True):
            if response.has_error():
                raise RequestError(response.error().message())
            tokens = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if tokens is None:
                continue  # the empty final response of a decoupled model
            forge_glue.send(sender, self._outputs(response, detokenizers), wanted=forge_glue.requested(request))
            sent_any = True
        tail = [d.flush() for d in detokenizers.values()]
        if any(tail):
            texts = np.array([[piece.encode("utf-8") for piece in tail]], dtype=object)
            return [self._text_tensor(texts)]
        if not sent_any:
            raise RequestError(f"{self.llm} finished without returning tokens")
        return None

    @staticmethod
    def _text_tensor(texts):
        # [batch * beams], as the postprocessing model and tensorrtllm_backend's BLS return it
        return pb_utils.Tensor("text_output", texts.reshape(-1))

    def _outputs(self, response, detokenizers):
        """The BLS outputs (text and passed-through tensors) of one tensorrt_llm response."""
        tokens = pb_utils.get_output_tensor_by_name(response, "output_ids").as_numpy()
        if tokens.ndim == 2:
            tokens = tokens[:, None, :]
        lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length")
        lengths = np.full(tokens.shape[:2], tokens.shape[2]) if lengths is None \
            else lengths.as_numpy().reshape(tokens.shape[0], -1)
        texts = np.empty(tokens.shape[:2], dtype=object)
        for b in range(tokens.shape[0]):
            for beam in range(tokens.shape[1]):
                ids = tokens[b, beam, :int(min(lengths[b, beam], tokens.shape[2]))].tolist()
                texts[b, beam] = self._text(ids, detokenizers, (b, beam))
        out = [self._text_tensor(texts)]
        for llm_name, bls_name in self.routes["outputs"]:
            tensor = pb_utils.get_output_tensor_by_name(response, llm_name)
            if tensor is not None and bls_name in self.outputs:
                out.append(pb_utils.Tensor(bls_name, tensor.as_numpy()))
        return out

    def _text(self, ids, detokenizers, key):
        if detokenizers is None:
            return forge_text.decode(self.tokenizer, ids, self.skip_special_tokens).encode("utf-8")
        state = detokenizers.get(key)
        if state is None:
            at_start = bool(ids) and self.tokenizer.bos_token_id is not None and ids[0] == self.tokenizer.bos_token_id
            state = detokenizers[key] = forge_text.IncrementalDetokenizer(self.codec, at_start=at_start)
            state.seen = []
        state.seen += ids
        if self.accumulate:  # the whole text so far, as the real BLS does with accumulate_tokens
            return forge_text.decode(self.tokenizer, state.seen, self.skip_special_tokens).encode("utf-8")
        return state.push(ids).encode("utf-8")
