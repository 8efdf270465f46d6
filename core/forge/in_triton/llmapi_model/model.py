"""The ``tensorrt_llm`` model of an LLM-API repository (``--target tensorrtllm``): TensorRT-LLM's LLM API in Triton.

forge writes this file to ``<repository>/tensorrt_llm/1/model.py`` with ``forge_llmapi.py`` (the request and
response mapping), ``forge_glue.py``, ``model.yaml`` (the LLM API's arguments plus ``triton_config``) and the
Hugging Face checkpoint in ``hf/``. It runs in the NGC ``tritonserver:<release>-trtllm-python-py3`` container,
on the public LLM API only: ``LLM(**model.yaml)``, ``SamplingParams``, ``LoRARequest`` and ``generate_async``.

One asyncio loop on its own thread drives the LLM; ``execute`` checks each request, schedules it there and
returns at once; responses go through each request's response sender (one final response when not streamed,
one per step in decoupled streaming). A watcher aborts generations whose client went away, every
``triton_config.cancellation_check_period_ms``.
"""

from __future__ import annotations

import asyncio
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
            return True

    def client_gone(self) -> bool:
        with self.finishing:
            return not self.done and self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        config = forge_glue.model_config(args)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
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
        self.llm = asyncio.run_coroutine_threadsafe(self._start(LLM, engine_args), self.loop).result()
        self.pending: dict[int, _Pending] = {}
        self.lock = threading.Lock()
        self.running = True
        self.watcher = threading.Thread(target=self._watch, name="forge-llmapi-cancel", daemon=True)
        self.watcher.start()

    async def _start(self, LLM, engine_args):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: LLM(**engine_args))

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
                                                         lora_request=lora, streaming=call["streaming"])
            prefix = parsed.prompt if parsed.echo else ""
            if call["streaming"]:
                async for output in pending.generation:
                    completion = output.outputs[0]
                    done = bool(output.finished)
                    self._send(pending, parsed, prefix + completion.text_diff, completion, done)
                    prefix = ""
                    if done:
                        return
            else:
                output = await pending.generation.aresult()
                self._send(pending, parsed, prefix + output.outputs[0].text, output.outputs[0], True)
        except Exception as exc:  # noqa: BLE001 - the client gets the error, the model serves on
            self._fail(pending, exc)
        finally:
            self._finish(pending)

    def _send(self, pending: _Pending, parsed, text: str, completion, final: bool) -> None:
        result = forge_llmapi.Completion(text=text, finish_reason=completion.finish_reason if final else None,
                                         stop_reason=completion.stop_reason,
                                         cumulative_logprob=completion.cumulative_logprob,
                                         perf=_perf(completion) if parsed.sampling.get("return_perf_metrics") else {})
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


def _perf(completion) -> dict:
    """The perf outputs the LLM API measured for ``completion`` (what it lacks is left out)."""
    metrics = getattr(completion, "request_perf_metrics", None)
    if metrics is None:
        return {}
    found = {}
    timing = getattr(metrics, "timing_metrics", None)
    for name, attribute in (("arrival_time_ns", "arrival_time"), ("first_scheduled_time_ns", "first_scheduled_time"),
                            ("first_token_time_ns", "first_token_time"), ("last_token_time_ns", "last_token_time")):
        value = getattr(timing, attribute, None)
        if value is not None:
            found[name] = int(value.total_seconds() * 1e9) if hasattr(value, "total_seconds") else int(value)
    kv = getattr(metrics, "kv_cache_metrics", None)
    for name, attribute in (("kv_cache_reused_block", "num_reused_blocks"),
                            ("kv_cache_missed_block", "num_missed_blocks"),
                            ("kv_cache_alloc_new_blocks", "num_new_allocated_blocks"),
                            ("kv_cache_alloc_total_blocks", "num_total_allocated_blocks"),
                            ("kv_cache_hit_rate", "kv_cache_hit_rate")):
        value = getattr(kv, attribute, None)
        if value is not None:
            found[name] = value
    speculative = getattr(metrics, "speculative_decoding", None)
    for name, attribute in (("acceptance_rate", "acceptance_rate"),
                            ("total_accepted_draft_tokens", "total_accepted_draft_tokens"),
                            ("total_draft_tokens", "total_draft_tokens")):
        value = getattr(speculative, attribute, None)
        if value is not None:
            found[name] = value
    return found
