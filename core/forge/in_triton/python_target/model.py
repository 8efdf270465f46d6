"""Triton python-backend model written by forge: a decoder behind the tensorrt_llm tensor interface.

forge copies this file to ``<repository>/tensorrt_llm/1/model.py``, the runtime package beside it (``forge_decoder/``)
and the Hugging Face weights to ``1/hf/``. ``execute`` only checks and queues requests; a continuous-batching engine
thread generates, so requests of different lengths share decoding steps and new ones join at any step, and hands every
update to a sender thread, which builds the responses and sends them while the engine runs its next step (on a GPU the
engine waits for the device without the GIL). There are SENDERS of them, each request's updates in order on one: a
send waits for the server's round trip without the GIL, so several keep more streams moving. In decoupled mode
streaming requests get one response per generated token while the senders keep up, and every token since the last
response in one where they fall behind.
"""

from __future__ import annotations

import collections
import gc
import itertools
import os
import queue
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

import forge_glue  # noqa: E402  (shipped next to this file)
from forge_decoder import hosted, loading  # noqa: E402
from forge_decoder.request import GenerationRequest, RequestError, is_stop, parse  # noqa: E402
from forge_decoder.responses import OutputSpec, Progress, Queued, RowResult, assemble, carried  # noqa: E402
from forge_decoder.sequences import Sequence, Update  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SENDERS = 4  # sender threads (-o sender_threads); one round trip to the server per response each
COALESCE_BACKLOG = 4  # items waiting for one sender past which a streamed token may join its sequence's waiting one
ENGINE_METRICS_S = 0.5  # metrics are published this often while the engine has work (each is an IPC call)
ENGINE_COUNTERS = ("step_seconds", "prefill_seconds", "decode_steps", "decoded_rows", "admitted", "queued_seconds",
                   "prefills")
DEVICE_COUNTERS = ("device_seconds", "wait_seconds")  # measured where the engine decodes through CUDA graphs
RESPONSE_COUNTERS = ("responses", "build_seconds", "send_seconds")


_parameter = loading.parameter


class _Request:
    """One Triton request being served: its rows, response sender and what was sent so far."""

    def __init__(self, model: "TritonPythonModel", sender, request_id: str, rows: list[GenerationRequest],
                 wanted: set[str] | None = None, text=None):
        self.model = model
        self.text = text  # textfront.TextStream: an LLM-API request, answered in text
        self.sender = sender
        self.wanted = wanted  # the outputs every response carries (responses.carried; None: all configured)
        self.request_id = request_id
        self.rows = rows
        self.streaming = any(r.streaming for r in rows)
        self.sequences: list[Sequence] = []
        self.results: dict[int, RowResult] = {}
        self.started: set = set()  # streaming rows that sent their first response
        self.held: dict[Sequence, Update] = {}  # their tokens waiting for the next response (-o stream_interval)
        self.queued: dict[Sequence, Queued] = {}  # each streaming sequence's last item in its sender's queue
        self.untaken: dict[Sequence, int] = {}  # each streaming sequence's items its sender has not taken
        self.ended: set = set()  # rows whose last update the sender delivered
        self.turn = next(model.turns) % len(model.outboxes)  # its updates' sender, in order
        self.outbox, self.firsts = model.outboxes[self.turn], model.firsts[self.turn]
        self.done = False
        self.counted = False  # in forge_glue.in_flight, until the final response is sent
        self.stopped = False  # a TensorRT-LLM ``stop`` request ended it: answer with what was generated
        self.lock = threading.Lock()
        self.finishing = threading.Lock()  # held around the final response and ``done``, see is_cancelled

    def is_cancelled(self) -> bool:
        """Whether the client went away; never asked once the final response is sent: tritonserver frees the
        response factory then, and asking crashes it (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled)."""
        with self.finishing:
            return self.done or self.sender.is_cancelled()

    def cancel(self, stopped: bool = False) -> None:
        self.stopped = self.stopped or stopped
        for seq in self.sequences:
            seq.cancel()

    def _pad(self) -> int:
        row = self.rows[0]
        return next((i for i in (row.pad_id, row.end_id) if i is not None), 0)

    def _send(self, results: list[RowResult] | None, final: bool, error: str | None = None) -> None:
        if not final:
            self._respond(results, final, error)
            return
        with self.finishing:
            self._respond(results, final, error)
            self.done = True
            counted, self.counted = self.counted, False
        forge_glue.in_flight.closed(counted)
        self.model.forget(self)

    def _respond(self, results: list[RowResult] | None, final: bool, error: str | None) -> None:
        started = time.perf_counter_ns()
        built = started
        try:
            if error is not None:
                forge_glue.send(self.sender, exc=RuntimeError(error), flags=FINAL)
            elif results is None:
                forge_glue.send(self.sender, flags=FINAL)
            else:
                if self.text is not None:  # an LLM-API request: text
                    row = results[0]
                    tensors = self.text.outputs(row.ids, row, final, row.reason, self.model.output_dtypes,
                                                self.wanted)
                else:  # only what the client asked for (see forge_glue), and only that is computed
                    tensors = assemble(results, self.model.output_specs, self._pad(), wanted=self.wanted)
                built = time.perf_counter_ns()
                forge_glue.send(self.sender, tensors, flags=FINAL if final else 0)
        except Exception as exc:  # the client went away; nothing else to do for it
            self.model.log_warn(f"could not send a response for request {self.request_id!r}: {exc}")
        self.model.sent(built - started, time.perf_counter_ns() - built)

    def on_update(self, seq: Sequence, update: Update) -> None:
        """Engine callback (engine thread): queue the update, with what it reads of the sequence as of now, for
        the sender thread (a request that does not stream: only its last). Where more than COALESCE_BACKLOG
        items, some of other sequences, wait for the sender, an update joins its sequence's item not taken yet:
        a sender behind its streams sends every token since a sequence's last response in one, the engine never
        waits for it, and a lone stream gets a response per token, as from TensorRT-LLM. A stream's first item
        also goes to ``firsts``, which the sender sends before the rest of its queue."""
        if not (self.streaming or update.finished):
            return
        if self.streaming and self.model.stream_interval > 1:
            update = self._due(seq, update, self.model.stream_interval)
            if update is None:
                return
        progress = Progress(seq.cum_logprob, seq.first_token_ns, seq.last_token_ns, len(seq.output))
        model = self.model
        with model.queue_lock:
            last, mine, waiting = self.queued.get(seq), self.untaken.get(seq, 0), model.untaken[self.turn]
            if last is not None and not last.taken and waiting > max(COALESCE_BACKLOG, mine):
                last.update, last.progress = last.update.then(update), progress
                return
            item = self.queued[seq] = Queued(self, seq, update, progress, model.queue_lock, self._taken)
            self.untaken[seq], model.untaken[self.turn] = mine + 1, waiting + 1
        if last is None and self.streaming:  # (in the queue too: it wakes the sender, which skips it once taken)
            self.firsts.append(item)
        self.outbox.put(item)

    def _taken(self, seq: Sequence) -> None:  # (the model's queue_lock held) a sender took one of seq's items
        self.untaken[seq] -= 1
        self.model.untaken[self.turn] -= 1

    def _due(self, seq: Sequence, update: Update, interval: int) -> Update | None:
        """``-o stream_interval``: the first token at once, then ``interval`` a response, and the last; None: held."""
        held = self.held.pop(seq, None)
        update = update if held is None else held.then(update)  # the output so far, if nothing was sent yet
        if update.finished or update.error or len(update.tokens) >= min(interval, len(seq.output)):
            return update
        self.held[seq] = update
        return None

    def deliver(self, seq: Sequence, update: Update, progress: Progress) -> None:
        """Sender thread: send what the update completes."""
        self.model.count(update, len(update.tokens) if self.streaming else progress.output_tokens)
        with self.lock:
            if self.done:
                return
            if update.error or (update.reason == "cancelled" and not self.stopped):
                # A client that cancelled is gone; the error only reaches callers of a failed step.
                self.cancel()
                self._send(None, True, update.error or "the request was cancelled")
                return
            req = seq.request
            if update.finished:
                self.ended.add(seq)
            # what the sender delivered, not the rows' live flags: a row the engine has finished may still
            # have its result waiting behind this update
            last = len(self.ended) == len(self.sequences)
            if self.streaming:
                if update.tokens:
                    first = seq not in self.started
                    self.started.add(seq)
                    self._send([self._row(seq, progress, update.tokens, update.logprobs, update.generation_logits,
                                          context=first, reason=update.reason if update.finished else None,
                                          top=update.top)], last)
                elif last and self.text is not None and update.finished:  # the text's tail and why it ended
                    self._send([self._row(seq, progress, [], [], [], reason=update.reason)], True)
                elif last:
                    self._send(None, True)
                return
            if not update.finished:
                return
            ids = seq.output if req.exclude_input else req.prompt + seq.output
            self.results[req.batch_index] = self._row(seq, progress, ids, seq.logprobs, seq.generation_logits,
                                                      context=True, reason=update.reason, top=seq.top)
            if self.model.decoupled:
                self._send([self.results[req.batch_index]], last)
            elif last:
                self._send([self.results[i] for i in sorted(self.results)], True)

    def _row(self, seq, progress: Progress, ids, logprobs, generation_logits, context: bool = False,
             reason: str | None = None, top: list | None = None) -> RowResult:
        req = seq.request
        return RowResult(ids=list(ids), logprobs=list(logprobs), cum_logprob=progress.cum_logprob,
                         want_logprobs=req.return_log_probs,
                         context_logits=seq.context_logits if context else None,
                         generation_logits=list(generation_logits), batch_index=req.batch_index,
                         arrival_ns=seq.arrival_ns, scheduled_ns=seq.scheduled_ns,
                         first_token_ns=progress.first_token_ns, last_token_ns=progress.last_token_ns,
                         input_tokens=len(req.prompt), output_tokens=progress.output_tokens, reason=reason,
                         top=list(top or ()), prompt_top=seq.prompt_top if context else None)


class TritonPythonModel:
    """The tensorrt_llm model of a forge ``--target python`` repository."""

    def initialize(self, args):
        config = forge_glue.model_config(args)
        self.name = args["model_name"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        forge_glue.in_flight.track()  # every answer goes through a response sender (see forge_glue.InFlight)
        self.output_specs = {
            o["name"]: OutputSpec(np.dtype(pb_utils.triton_string_to_numpy(o["data_type"])), len(o["dims"]))
            for o in config["output"]}
        self.output_dtypes = {name: spec.dtype for name, spec in self.output_specs.items()}
        here = Path(__file__).resolve().parent
        self.front = self._text_front(config, here)
        self.exclude_input = _parameter(config, "exclude_input_in_output", "false").lower() in forge_glue.TRUE
        # "asked": the outputs of the executor-based backend (v0.14.0 on), see responses.carried
        outputs = _parameter(config, "response_outputs", "all")
        if outputs not in ("asked", "all"):
            raise ValueError(f"parameter response_outputs={outputs}: expected asked or all")
        self.asked_only = outputs == "asked"
        self.stream_interval = int(_parameter(config, "stream_interval", "") or 1)
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval is {self.stream_interval}: at least 1 token per streamed response")
        log = {"info": pb_utils.Logger.log_info, "warn": pb_utils.Logger.log_warn, "error": pb_utils.Logger.log_error}
        if self._hosted(config):  # the engine in its own process; adapters and guides resolved there
            self.engine = hosted.EngineHost(
                config, here, name=self.name, cancel_check_ms=float(_parameter(config, "cancellation_check_period_ms",
                                                                               "100")), **log)
            self.limits, self.loaded = self.engine.limits, None
            summary, graphs = self.engine.summary + ", engine in its own process", self.engine.graphs
        else:
            self.loaded = loading.load_apart(config, here, name=self.name, **log)
            self.engine, self.limits = self.loaded.engine, self.loaded.limits
            summary, graphs = self.loaded.summary, self.loaded.graphs
        self.requests: dict[int, _Request] = {}
        self.lock = threading.Lock()
        self._metrics()
        # Queued items per sender thread; None: stop
        senders = int(_parameter(config, "sender_threads", "") or SENDERS)
        if senders < 1:
            raise ValueError(f"sender_threads is {senders}: at least one thread must send the responses")
        self.outboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(senders)]
        self.firsts: list[collections.deque] = [collections.deque() for _ in range(senders)]  # streams' first items
        self.untaken = [0] * senders  # items each sender has not taken (the queue less the firsts sent ahead)
        self.queue_lock = threading.Lock()  # the counts, and an item's update and its taking
        self.turns = itertools.count()
        self.count_lock = threading.Lock()  # the metrics' local sums, shared by the senders
        self.publisher_stop = threading.Event()
        self.publisher = threading.Thread(target=self._publisher, name="forge-metrics", daemon=True)
        self.publisher.start()
        self.senders = [threading.Thread(target=self._send_loop, args=(self.outboxes[i], self.firsts[i]),
                                         name=f"forge-sender-{i}", daemon=True) for i in range(senders)]
        for thread in self.senders:
            thread.start()
        if not isinstance(self.engine, hosted.EngineHost):
            self.engine.start()
        pb_utils.Logger.log_info(
            f"forge python target {self.name!r}: {summary}, {senders} sender threads, max_input_len "
            f"{self.limits.max_input_len}, max_seq_len {self.limits.max_seq_len}, decoupled {self.decoupled}, "
            f"CUDA graphs {graphs}")

    @staticmethod
    def _text_front(config: dict, here: Path):
        """The LLM-API interface (``text_input`` in, ``text_output`` out) when the profile has it, else None."""
        if not any(i["name"] == "text_input" for i in config["input"]):
            return None
        from forge_decoder.textfront import TextFront

        params = forge_glue.parameters(config)
        return TextFront(str(here / params.get("tokenizer_dir", "hf")), params,
                         trust_remote_code=forge_glue.parse_bool(params.get("trust_remote_code"), False))

    @staticmethod
    def _hosted(config: dict) -> bool:
        """``-o engine_process``: auto runs the engine in its own process where it decodes on a GPU (the stub's
        threads would take the interpreter lock from it between its launches; at tp > 1 that process leads the
        ranks); true: anywhere."""
        mode = _parameter(config, "engine_process", "auto").lower()
        if mode not in ("auto", "true", "false"):
            raise ValueError(f"-o engine_process={mode}: expected auto, true or false")
        return mode == "true" or (mode == "auto" and loading.choose_device(config).type == "cuda")

    def _metrics(self) -> None:
        """Gauges and counters on Triton's metrics endpoint (cancellations show up there)."""
        self.metric_sequences = pb_utils.MetricFamily(
            name="forge_decoder_sequences", description="sequences waiting for or in generation",
            kind=pb_utils.MetricFamily.GAUGE)
        self.metric_waiting = pb_utils.MetricFamily(
            name="forge_decoder_waiting", description="sequences waiting: queued for the engine, not admitted to its "
            "decoding batch yet (part of forge_decoder_sequences)", kind=pb_utils.MetricFamily.GAUGE)
        self.metric_finished = pb_utils.MetricFamily(
            name="forge_decoder_finished_total", description="sequences finished, by reason",
            kind=pb_utils.MetricFamily.COUNTER)
        self.metric_tokens = pb_utils.MetricFamily(
            name="forge_decoder_generated_tokens_total", description="tokens generated",
            kind=pb_utils.MetricFamily.COUNTER)
        self.metric_engine = pb_utils.MetricFamily(
            name="forge_decoder_engine_total", description="the engine thread: seconds inside steps "
            "(kind=step_seconds) and prefills (kind=prefill_seconds), decoding steps (kind=decode_steps) and rows "
            "summed over them (kind=decoded_rows), sequences admitted (kind=admitted) and their seconds waited in "
            "the engine's queue (kind=queued_seconds) and prefills run (kind=prefills); with CUDA graphs on a GPU "
            "also the device's seconds in decoding steps (kind=device_seconds) and the engine thread's seconds "
            "waiting for their tokens (kind=wait_seconds)", kind=pb_utils.MetricFamily.COUNTER)
        labels = {"model": self.name}
        kinds = ENGINE_COUNTERS + (DEVICE_COUNTERS if self.engine.timed else ())
        self.engine_counters = {kind: self.metric_engine.Metric(labels={**labels, "kind": kind}) for kind in kinds}
        self.published_engine = {kind: 0.0 for kind in self.engine_counters}
        self.published_busy = self.published_waiting = -1
        self.unpublished_tokens = 0
        self.metric_responses = pb_utils.MetricFamily(
            name="forge_decoder_responses_total", description="the sender threads: responses sent (kind=responses), "
            "seconds building their tensors (kind=build_seconds) and inside the server's send call, a round trip to "
            "tritonserver (kind=send_seconds)", kind=pb_utils.MetricFamily.COUNTER)
        self.response_counters = {kind: self.metric_responses.Metric(labels={**labels, "kind": kind})
                                  for kind in RESPONSE_COUNTERS}
        self.unpublished_responses = dict.fromkeys(RESPONSE_COUNTERS, 0.0)
        self.busy_gauge = self.metric_sequences.Metric(labels=labels)
        self.waiting_gauge = self.metric_waiting.Metric(labels=labels)
        self.token_counter = self.metric_tokens.Metric(labels=labels)
        self.finished = {reason: self.metric_finished.Metric(labels={**labels, "reason": reason})
                         for reason in ("length", "end_id", "stop_words", "cancelled", "error")}
        self.unpublished_finished = dict.fromkeys(self.finished, 0)

    def sent(self, build_ns: int, send_ns: int) -> None:
        """A sender thread sent one response: ``build_ns`` building its tensors, ``send_ns`` in the send call."""
        with self.count_lock:
            for kind, value in (("responses", 1), ("build_seconds", build_ns / 1e9), ("send_seconds", send_ns / 1e9)):
                self.unpublished_responses[kind] += value

    def count(self, update: Update, tokens: int) -> None:
        """Metrics are IPC calls to the server, each holding this stub's GIL: count ``tokens`` generated and
        sequences finished locally; they are published when the engine falls idle and otherwise by the
        publisher thread, every ENGINE_METRICS_S."""
        with self.count_lock:
            self.unpublished_tokens += tokens
            if not update.finished or self.token_counter is None:
                return
            if update.reason in self.unpublished_finished:
                self.unpublished_finished[update.reason] += 1
            if not self.engine.busy:
                self._publish()

    def _publisher(self) -> None:
        """Publishes what was counted every ENGINE_METRICS_S until ``finalize``."""
        while not self.publisher_stop.wait(ENGINE_METRICS_S):
            with self.count_lock:
                if self.token_counter is None:
                    return
                self._publish()

    def _publish(self) -> None:
        """(count_lock held) What was counted locally since the last time, and the engine's counters, to the
        metrics endpoint (only what changed: each is an IPC call)."""
        waiting, busy = self.engine.waiting, self.engine.busy
        if busy != self.published_busy:
            self.busy_gauge.set(busy)
            self.published_busy = busy
        if waiting != self.published_waiting:
            self.waiting_gauge.set(waiting)
            self.published_waiting = waiting
        if self.unpublished_tokens:
            self.token_counter.increment(self.unpublished_tokens)
            self.unpublished_tokens = 0
        for reason, count in self.unpublished_finished.items():
            if count:
                self.finished[reason].increment(count)
                self.unpublished_finished[reason] = 0
        for kind, counter in self.response_counters.items():
            if self.unpublished_responses[kind]:
                counter.increment(self.unpublished_responses[kind])
                self.unpublished_responses[kind] = 0.0
        engine = self.engine
        values = {"step_seconds": engine.step_ns / 1e9, "decode_steps": float(engine.decode_steps),
                  "decoded_rows": float(engine.decoded_rows), "prefill_seconds": engine.prefill_ns / 1e9,
                  "admitted": float(engine.admitted), "queued_seconds": engine.queued_ns / 1e9,
                  "prefills": float(engine.prefills),
                  "device_seconds": engine.device_ns / 1e9, "wait_seconds": engine.wait_ns / 1e9}
        for kind, counter in self.engine_counters.items():
            value = values[kind]
            if value != self.published_engine[kind]:
                counter.increment(value - self.published_engine[kind])
                self.published_engine[kind] = value

    def _send_loop(self, outbox: queue.SimpleQueue, firsts: collections.deque) -> None:
        while (item := outbox.get()) is not None:
            forge_glue.exit_if_orphaned()
            while firsts:
                self._deliver(firsts.popleft())
            self._deliver(item)

    def _deliver(self, item: Queued) -> None:
        if (taken := item.take()) is None:  # a stream's first item, sent ahead of the queue
            return
        request = item.owner
        try:
            request.deliver(item.seq, *taken)
        except Exception as exc:  # one request's failure must not stop everyone's responses
            self.log_warn(f"could not answer request {request.request_id!r}: {type(exc).__name__}: {exc}")
            request.cancel()

    def log_warn(self, message: str) -> None:
        pb_utils.Logger.log_warn(message)

    def forget(self, request: _Request) -> None:
        with self.lock:
            self.requests.pop(id(request), None)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            request_id = request.request_id()
            text = None
            try:
                tensors = {t.name(): t.as_numpy() for t in request.inputs()}
                if is_stop(tensors):  # TensorRT-LLM's stop input: cancel the running request with the same id
                    forge_glue.stop_request(sender, request_id, self.requests.values,
                                            lambda victim: victim.cancel(stopped=True), self.lock)
                    continue
                if self.front is not None:  # text in: the same generation as token tensors
                    parsed, tensors = self.front.request(tensors, decoupled=self.decoupled,
                                                         max_tokens_limit=self.limits.max_seq_len)
                    text = self.front.stream(parsed)
                rows = parse(tensors, self.limits, decoupled=self.decoupled, exclude_input=self.exclude_input,
                             warn=pb_utils.Logger.log_warn)
                if text is not None:
                    text.ask(rows)
                if self.loaded is not None:  # else the engine process resolves adapters and guides
                    self.loaded.prepare(rows)  # a bad guide or adapter: RequestError
            except (RequestError, ValueError) as exc:  # forge_llmapi.RequestError is a ValueError too
                forge_glue.send(sender, exc=exc, flags=FINAL)
                continue
            except Exception as exc:  # malformed tensors: still one clear error, never a dead model
                forge_glue.send(sender, exc=ValueError(f"invalid request: {type(exc).__name__}: {exc}"), flags=FINAL)
                continue
            wanted = forge_glue.requested(request)
            pending = _Request(self, sender, request_id, rows, wanted if text is not None else
                               carried(rows, self.output_specs, wanted, self.asked_only), text)
            pending.sequences = [Sequence(row, pending.on_update, pending.is_cancelled, pending)
                                 for row in rows]
            pending.counted = forge_glue.in_flight.opened(request_id)
            with self.lock:
                self.requests[id(pending)] = pending
            self.engine.submit(pending.sequences)
        return None

    def finalize(self):
        """Stop before the stub tears down: the engine thread ends failing what it held, the senders send what it
        reported (bounded waits), what is still pending gets its error, and every response sender and metric is
        released while the stub's channels work (one destroyed in interpreter teardown crashes the stub)."""
        forge_glue.exit_if_orphaned()  # a dead server: nothing to answer, and calls into it can block
        self.publisher_stop.set()
        self.publisher.join(timeout=2.0)
        ended = self.engine.stop(timeout=5.0)
        forge_glue.exit_if_orphaned()
        for outbox in self.outboxes:  # the senders answer what the engine reported up to here, then stop
            outbox.put(None)
        deadline = time.monotonic() + 5.0
        for thread in self.senders:
            thread.join(max(0.0, deadline - time.monotonic()))
        ended = ended and not any(thread.is_alive() for thread in self.senders)
        with self.lock:
            left = list(self.requests.values())
            self.requests.clear()
        for request in left:
            if not request.lock.acquire(timeout=1.0):  # the engine thread is stuck sending to it
                continue
            try:
                if not request.done:
                    request._send(None, True, "the model is being unloaded")
                request.done = True
                request.sender = _CLOSED
            finally:
                request.lock.release()
        if ended:  # nothing left that counts: release the metrics while their channel is open
            self.busy_gauge = self.token_counter = self.finished = self.engine_counters = self.response_counters = None
            self.waiting_gauge = self.metric_waiting = self.metric_responses = None
            self.metric_sequences = self.metric_finished = self.metric_tokens = self.metric_engine = None
        # Finished requests are cycles (request → sequence → its callback → request) that only the cyclic
        # collector frees; left to the interpreter's teardown, their senders' destructors use the stub's
        # shared memory after it is gone (a segfault in ResponseSender::~ResponseSender under
        # Py_FinalizeEx). Collect them now.
        gc.collect()


#: A response sender after ``finalize``: sends nothing, and every request reads as cancelled.
_CLOSED = SimpleNamespace(send=lambda *args, **kwargs: None, is_cancelled=lambda: True)
