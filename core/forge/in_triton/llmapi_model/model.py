"""The ``tensorrt_llm`` model of an LLM-API repository (``--target tensorrtllm``): TensorRT-LLM's LLM API in Triton.

forge writes this file to ``<repository>/tensorrt_llm/1/model.py`` with ``forge_llmapi.py`` (the request and
response mapping), ``forge_glue.py``, ``model.yaml`` (the LLM API's arguments plus ``triton_config``) and the
Hugging Face checkpoint in ``hf/``. It runs in the NGC ``tritonserver:<release>-trtllm-python-py3`` container,
on the public LLM API only: ``LLM(**model.yaml)``, ``SamplingParams``, ``LoRARequest`` and ``generate_async``.

One asyncio loop on its own thread drives the LLM; ``execute`` checks each request, schedules it there and
returns at once; responses go through each request's response sender (one final response when not streamed,
one per step in decoupled streaming). A watcher aborts generations whose client went away, every
``triton_config.cancellation_check_period_ms``.

forge's additions to the interface (``forge_llmapi.EXTENSION_INPUTS`` / ``EXTENSION_OUTPUTS``) map onto the
same LLM API: ``prompt_token_ids`` becomes the prompt as token ids, ``sampling_param_logprobs`` /
``_prompt_logprobs`` / ``_ignore_eos`` / ``_min_tokens`` / ``_repetition_penalty`` the ``SamplingParams``
keywords of those names, and ``forge_llmapi.LLMAnswer`` reads the log-probs and token counts back from each
``RequestOutput``, each token's text from the LLM's own tokenizer.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

import forge_glue  # noqa: E402
import forge_llmapi  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CONFIG = os.environ.get("LLM_CONFIG_PATH", "model.yaml")


class _Pending:
    """A request in flight: its sender, the generation (to abort) and whether its final response went out."""

    def __init__(self, request_id: str, sender, wanted):
        self.request_id, self.sender, self.wanted = request_id, sender, wanted
        self.generation = None
        self.done = False
        self.counted = forge_glue.in_flight.opened(request_id)  # until its final response (see forge_glue.InFlight)
        # held around the final response and ``done``: a request is never asked whether its client went away once
        # its final response is out (tritonserver frees its response factory then; asking crashes it)
        self.finishing = threading.Lock()

    def finish(self, *args, **kwargs) -> bool:
        """Send the final response (``forge_glue.send`` arguments) unless one went out; whether this sent it."""
        with self.finishing:
            if self.done:
                return False
            forge_glue.send(self.sender, *args, flags=FINAL, **kwargs)
            self.done = True
        forge_glue.in_flight.closed(self.counted)
        return True

    def client_gone(self) -> bool:
        with self.finishing:
            return not self.done and self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        config = forge_glue.model_config(args)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        forge_glue.in_flight.track()  # every answer goes through a response sender
        self.outputs = {o["name"]: np.dtype(pb_utils.triton_string_to_numpy(o["data_type"])) for o in config["output"]}
        engine_args, triton = forge_llmapi.engine_arguments(CONFIG, HERE)
        if bool(triton["decoupled"]) != self.decoupled:
            raise ValueError(f"model.yaml triton_config.decoupled is {triton['decoupled']} but config.pbtxt says "
                             f"{self.decoupled}: rebuild the repository")
        self.multimodal = bool(triton.get("multimodal", False))
        self.check_s = float(triton.get("cancellation_check_period_ms", 100)) / 1000.0
        from tensorrt_llm import LLM, SamplingParams  # after the environment is settled (CUDA is not fork-safe)
        from tensorrt_llm.executor import LoRARequest

        self.SamplingParams, self.LoRARequest = SamplingParams, LoRARequest
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="forge-llmapi", daemon=True)
        self.thread.start()
        pb_utils.Logger.log_info(f"forge llmapi: starting the LLM with {engine_args}")
        self.vocab_size = forge_llmapi.checkpoint_vocab_size(str(engine_args.get("model", "")))
        self.llm = asyncio.run_coroutine_threadsafe(self._start(LLM, engine_args), self.loop).result()
        self.tokenizer = getattr(self.llm, "tokenizer", None)  # the LLM API's TokenizerBase (transformers' inside)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        self.pending: dict[int, _Pending] = {}
        self.lock = threading.Lock()
        self.running = True
        self.watcher = threading.Thread(target=self._watch, name="forge-llmapi-cancel", daemon=True)
        self.watcher.start()

    async def _start(self, LLM, engine_args):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: LLM(**engine_args))

    def _decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens kept (what an echoed token-id prompt and a token's log-prob show)."""
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        except TypeError:  # a TokenizerBase whose decode takes no keywords
            return self.tokenizer.decode(ids)

    def _token_text(self, token: int) -> str:
        return self._decode([token])

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            request_id = request.request_id()
            try:
                tensors = {t.name(): t.as_numpy() for t in request.inputs()}
                if forge_llmapi.is_stop(tensors):
                    forge_glue.stop_request(sender, request_id, self.pending.values, self._abort, self.lock)
                    continue
                parsed = forge_llmapi.parse(tensors, decoupled=self.decoupled, multimodal=self.multimodal)
                if parsed.prompt_ids is not None:
                    forge_llmapi.check_token_ids(parsed.prompt_ids, self.vocab_size)
                    if parsed.echo:
                        parsed.prompt = self._decode(parsed.prompt_ids)  # what the echo shows
                call = forge_llmapi.request_arguments(parsed, HERE)
            except forge_llmapi.RequestError as exc:
                forge_glue.send(sender, exc=exc, flags=FINAL)
                continue
            except Exception as exc:  # noqa: BLE001 - malformed tensors: one clear error, the model serves on
                forge_glue.send(sender, exc=ValueError(f"invalid request: {type(exc).__name__}: {exc}"), flags=FINAL)
                continue
            pending = _Pending(request_id, sender, forge_glue.requested(request))
            with self.lock:
                self.pending[id(pending)] = pending
            asyncio.run_coroutine_threadsafe(self._generate(pending, parsed, call), self.loop)
        return None

    async def _generate(self, pending: _Pending, parsed: forge_llmapi.LLMRequest, call: dict) -> None:
        try:
            sampling = self.SamplingParams(**call["sampling"])
            lora = None if call["lora"] is None else self.LoRARequest(**call["lora"])
            pending.generation = self.llm.generate_async(call["inputs"], sampling_params=sampling,
                                                         lora_request=lora, streaming=call["streaming"],
                                                         **call["options"])
            answer = forge_llmapi.LLMAnswer(parsed, self.token_text)
            if call["streaming"]:
                async for output in pending.generation:
                    done = bool(output.finished)
                    self._send(pending, parsed, answer.completion(output, done), done)
                    if done:
                        return
            else:
                output = await pending.generation.aresult()
                self._send(pending, parsed, answer.completion(output, True), True)
        except Exception as exc:  # noqa: BLE001 - the client gets the error, the model serves on
            if pending.generation is not None and not pending.generation.finished:
                self._abort(pending)  # nothing reads the rest of a failed generation
            self._fail(pending, exc)
        finally:
            self._finish(pending)

    def _send(self, pending: _Pending, parsed, result: forge_llmapi.Completion, final: bool) -> None:
        tensors = forge_llmapi.outputs(result, parsed, self.outputs, pending.wanted)
        if final:
            pending.finish(tensors)
        else:
            forge_glue.send(pending.sender, tensors, flags=0)

    def _fail(self, pending: _Pending, exc: BaseException) -> None:
        pending.finish(exc=RuntimeError(f"{type(exc).__name__}: {exc}"))

    def _finish(self, pending: _Pending) -> None:
        pending.finish(exc=RuntimeError("the request was cancelled"))
        with self.lock:
            self.pending.pop(id(pending), None)

    def _abort(self, pending: _Pending) -> None:
        if pending.generation is not None:
            self.loop.call_soon_threadsafe(pending.generation.abort)

    def _watch(self) -> None:
        """Aborts the generations whose client went away."""
        while self.running:
            time.sleep(self.check_s)
            with self.lock:
                pending = list(self.pending.values())
            for item in pending:
                if item.client_gone():
                    self._abort(item)

    def finalize(self):
        self.running = False
        with self.lock:
            left = list(self.pending.values())
        for item in left:
            self._abort(item)
            self._fail(item, RuntimeError("the model is being unloaded"))
        try:
            self.llm.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5.0)

