"""The vLLM engine process of forge's ``vllm`` backend, run by the Python of the vLLM environment.

``python forge_vllm_engine.py --version-dir DIR --fd N [--metrics]``: reads ``DIR/model.json`` (vLLM's engine
arguments, given to ``AsyncEngineArgs`` as they are) and ``DIR/multi_lora.json``, starts vLLM's ``AsyncLLM`` and
serves the stub over the socket ``N`` (:mod:`forge_vllm_wire`); with ``--metrics``, vLLM's statistics of each
engine step too (:func:`stats_message`, which the stub reports as Triton metrics). vLLM pins its own torch and
numpy while the bundled tritonserver's python stub needs numpy < 2, so the engine cannot live in the stub. It ends
with the stub: when the socket closes, when its parent changes (the stub died; checked every PARENT_POLL_S) or on
SIGTERM, it kills its own process group (vLLM's engine-core processes included) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import socket
import sys
import traceback
from typing import Any

import forge_vllm_wire as wire  # shipped beside this file

PARENT_POLL_S = 0.5


def _die_with_group(*_args) -> None:
    """Every process of this group (this one and vLLM's engine cores) ends now."""
    try:
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(1)


def stats_message(scheduler_stats, iteration_stats) -> dict:
    """One engine step's statistics (vLLM's ``SchedulerStats`` / ``IterationStats``, either may be None)."""
    message: dict[str, Any] = {"op": "stats"}
    if scheduler_stats is not None:
        message.update(running=scheduler_stats.num_running_reqs, waiting=scheduler_stats.num_waiting_reqs,
                       kv_cache_usage=scheduler_stats.kv_cache_usage)
    if iteration_stats is not None:
        finished = iteration_stats.finished_requests
        message.update(prompt_tokens=iteration_stats.num_prompt_tokens,
                       generation_tokens=iteration_stats.num_generation_tokens,
                       ttft=list(iteration_stats.time_to_first_tokens_iter),
                       tpot=list(iteration_stats.inter_token_latencies_iter),
                       e2e=[f.e2e_latency for f in finished],
                       request_prompt_tokens=[f.num_prompt_tokens for f in finished],
                       request_generation_tokens=[f.num_generation_tokens for f in finished],
                       n=list(iteration_stats.n_params_iter))
    return message


def stats_relay(send):
    """A vLLM stat logger (a per-engine factory) that sends each step's statistics with ``send``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Relay(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            send(stats_message(scheduler_stats, iteration_stats))

        def log_engine_initialized(self):
            pass

    return Relay


class Engine:
    def __init__(self, version_dir: str, writer: asyncio.StreamWriter, metrics: bool = False):
        self.version_dir = version_dir
        self.writer = writer
        self.metrics = metrics
        self.tasks: dict[str, asyncio.Task] = {}
        self.outbox: list[bytes] = []  # messages written together once the loop's ready tasks have run
        self.loop = asyncio.get_running_loop()
        self.engine = None
        self.loras: dict[str, str] = {}

    def send(self, message: dict) -> None:
        """Queue ``message``: the outputs of one engine step go to the stub in one write (one wake-up there)."""
        self.outbox.append(wire.pack(message))
        if len(self.outbox) == 1:
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        if self.outbox:
            self.writer.write(b"".join(self.outbox))
            self.outbox.clear()

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        with open(os.path.join(self.version_dir, "model.json")) as file:
            arguments = json.load(file)
        if str(arguments.get("enable_lora", "")).lower() == "true":
            with open(os.path.join(self.version_dir, "multi_lora.json")) as file:
                self.loras = json.load(file)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments),
                                                usage_context=UsageContext.OPENAI_API_SERVER,
                                                stat_loggers=[stats_relay(self.send)] if self.metrics else None)

    def submit(self, message: dict) -> None:
        task = asyncio.get_running_loop().create_task(self.generate(message))
        self.tasks[message["id"]] = task
        task.add_done_callback(lambda _t, rid=message["id"]: self.tasks.pop(rid, None))

    def abort(self, rid: str) -> None:
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()  # AsyncLLM.generate aborts the request in the engine when cancelled

    async def generate(self, message: dict) -> None:
        rid = message["id"]
        try:
            params, lora = sampling(message["parameters"], stream=message["stream"])
            lora_request = None
            if lora is not None:
                from vllm.lora.request import LoRARequest

                names = list(self.loras)
                lora_request = LoRARequest(lora, names.index(lora) + 1, self.loras[lora])
            prompt: Any = message["prompt"]
            if message.get("images"):
                prompt = {"prompt": prompt, "multi_modal_data": {"image": [_image(i) for i in message["images"]]}}
            shaper = Shaper(message)
            async for output in self.engine.generate(prompt, params, rid, lora_request=lora_request):
                self.send({"id": rid, "final": output.finished, "outputs": shaper.outputs(output)})
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - the request's own error; the engine serves on
            self.send({"id": rid, "error": f"{type(exc).__name__}: {exc}"})


def _image(text: str):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")


def sampling(text: str, *, stream: bool):
    """``sampling_parameters`` (a JSON object of vLLM ``SamplingParams`` fields, plus ``lora_name``) → the
    parameters and the adapter's name; an unknown key or a bad value raises ValueError naming it."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    values = json.loads(text) if text else {}
    if not isinstance(values, dict):
        raise ValueError(f"sampling_parameters must be a JSON object, got {type(values).__name__}")
    lora = values.pop("lora_name", None)
    fields = set(SamplingParams.__struct_fields__)
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown sampling parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    types = SamplingParams.__annotations__
    for key, value in list(values.items()):
        if key == "structured_outputs":
            values[key] = StructuredOutputsParams(**(json.loads(value) if isinstance(value, str) else value))
        elif isinstance(value, str) and any(t in str(types.get(key, "")) for t in ("int", "float", "bool")):
            values[key] = _scalar(key, value)  # numbers sent as strings, as the vLLM backend takes them
    params = SamplingParams(**values)
    params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return params, lora


def _scalar(key: str, value: str) -> Any:
    try:
        number = float(value)
    except ValueError:
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"sampling parameter {key}={value!r} is not a number") from None
    return int(number) if number.is_integer() and "." not in value else number


class Shaper:
    """One request's responses: the outputs it asked for (``return_*``), text with the prompt in front once
    when ``exclude_input_in_output`` is false."""

    def __init__(self, message: dict):
        self.prepend = message["prepend"]
        self.wanted = set(message["returns"])

    def outputs(self, output) -> dict:
        texts = [c.text for c in output.outputs]
        if self.prepend:
            texts = [(output.prompt or "") + t for t in texts]
            self.prepend = False
        shaped: dict[str, Any] = {"text_output": texts}
        if "finish_reason" in self.wanted:
            shaped["finish_reason"] = [str(c.finish_reason) for c in output.outputs]
        if "cumulative_logprob" in self.wanted:
            shaped["cumulative_logprob"] = [c.cumulative_logprob or 0.0 for c in output.outputs]
        if "logprobs" in self.wanted:
            shaped["logprobs"] = [json.dumps(_logprobs(c.logprobs)) if c.logprobs is not None else "null"
                                  for c in output.outputs]
        if "num_input_tokens" in self.wanted:
            shaped["num_input_tokens"] = [len(output.prompt_token_ids or [])]
        if "num_output_tokens" in self.wanted:
            shaped["num_output_tokens"] = [len(c.token_ids) for c in output.outputs]
        return shaped


def _logprobs(steps) -> list[dict]:
    """vLLM's per-token log-probs as the vLLM backend writes them: token id → logprob, rank, decoded token."""
    return [{str(token): {"logprob": p.logprob, "rank": p.rank, "decoded_token": p.decoded_token}
             for token, p in step.items()} for step in steps]


async def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    _die_with_group()


async def serve(version_dir: str, fd: int, parent: int, metrics: bool = False) -> int:
    watcher = asyncio.get_running_loop().create_task(_watch_parent(parent))
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    engine = Engine(version_dir, writer, metrics)
    try:
        await engine.start()
    except Exception as exc:  # noqa: BLE001 - told to the stub in one line, then this process ends
        traceback.print_exc()
        engine.send({"op": "fatal", "error": f"{type(exc).__name__}: {exc}"})
        engine.flush()
        await writer.drain()
        return 1
    import vllm

    engine.send({"op": "ready", "vllm": vllm.__version__,
                 "max_model_len": engine.engine.vllm_config.model_config.max_model_len})
    while True:
        try:
            head = await reader.readexactly(wire.HEADER.size)
            message = wire.unpack(await reader.readexactly(wire.HEADER.unpack(head)[0]))
        except (asyncio.IncompleteReadError, ConnectionError):
            return 0  # the stub is gone or finalizing
        if watcher.done():
            return 0
        if message["op"] == "generate":
            engine.submit(message)
        elif message["op"] == "abort":
            engine.abort(message["id"])
        await writer.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version-dir", required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--metrics", action="store_true", help="send vLLM's statistics of each engine step")
    args = parser.parse_args()
    parent = os.getppid()
    if os.getpgrp() != os.getpid():
        os.setpgrp()
    signal.signal(signal.SIGTERM, _die_with_group)
    asyncio.run(serve(args.version_dir, args.fd, parent, args.metrics))
    sys.stdout.flush()
    sys.stderr.flush()
    _die_with_group()  # vLLM's engine cores too, without waiting on their teardown


if __name__ == "__main__":
    main()
