"""Continuous batching over a Hugging Face causal LM: sequences join and leave between steps.

One thread owns the model. Each iteration it admits waiting sequences (one batched, left-padded
prefill), merges their KV caches into the running batch, runs one decoding step for every
running sequence, reports new tokens through each sequence's callback and drops the finished
ones. Sequences of different prompt lengths, output lengths and sampling parameters share steps.
Whom an iteration admits is the scheduler's policy (scheduler.py); through the CUDA-graph decoder
(graph_steps.py) the decoding steps of plain greedy rows overlap (``Engine.overlap``): a step is
launched before the host has read the one before it.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from . import graphs, guided, sampling, toplogprobs
from . import device as where
from .graph_steps import GraphSteps
from .request import Limits
from .scheduler import ADMIT_WAIT_S, Scheduler
from .sequences import Sequence, Update

choose_device = where.choose_device  # where the decoder runs (a module of its own: see device.py)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def filled_holes(live: list[int]) -> list[int]:
    """The order of the surviving rows ``live`` (ascending) once packed to the front: a row already within the
    first ``len(live)`` stays where it is, and the rows past them move into the holes of the finished ones."""
    n = len(live)
    stay = {row for row in live if row < n}
    tail = iter(row for row in live if row >= n)
    return [slot if slot in stay else next(tail) for slot in range(n)]


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); else torch emulates it slowly."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def choose_dtype(device: torch.device, name: str, checkpoint: str = "float16") -> torch.dtype:
    """The compute dtype: ``name`` when given, else (``auto``) the fast one for ``device``.

    auto: on a GPU the build's dtype (``checkpoint``); on a CPU bfloat16 where it has bf16 matmuls,
    else float32 (float16 matmuls on CPUs are emulated and several times slower).
    """
    if name in ("", "auto"):
        if device.type != "cpu":
            return DTYPES.get(checkpoint, torch.float16)
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return DTYPES.get(name, torch.float32)


GPU_ROWS = 64  # sequences in flight on a GPU by default: one decode step costs about the same at 1 and 64 rows
#: sequences in flight on a CPU by default. A step's cost grows with its rows there, but less than its tokens do
#: (2-core AVX-512 EPYC, SmolLM2-135M bf16, 64 new tokens: 32 rows served 323 tok/s at c=32 where 8 served 137,
#: and the same 142 at c=8). The KV cache grows with the tokens held, at most rows × max_seq_len of them.
CPU_ROWS = 32


def choose_rows(device: torch.device, requested: int, max_batch_size: int) -> int:
    """Sequences decoded together: ``requested`` when > 0, else (auto) at least GPU_ROWS on a GPU and CPU_ROWS
    on a CPU (see both). Triton's max_batch_size still bounds the rows of one request."""
    if requested > 0:
        return requested
    return max(max_batch_size, GPU_ROWS if device.type == "cuda" else CPU_ROWS)


def choose_threads(device: torch.device, requested: int, dtype: torch.dtype | None = None) -> int:
    """torch intra-op threads: ``requested`` when > 0, else (auto) on a CPU:

    * computing in bfloat16 on a CPU with bf16 matmuls: every core this process may use. Such steps are
      compute-heavy enough that the second core pays (2-core AVX512-BF16 EPYC, SmolLM2-135M, 8 requests
      in flight: 133 generated tok/s with 2 threads, 91 with 1);
    * otherwise (float32, memory-bound steps): every core but one, which stays with tritonserver,
      pre/post-processing and the network (2-core AVX2 EPYC: a team as large as the machine waited on
      those processes and served half the tokens/s).

    On a GPU torch's default (it only feeds the device)."""
    if requested > 0:
        return requested
    if device.type == "cpu":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        if dtype == torch.bfloat16 and cpu_has_bf16():
            return cores
        return max(1, cores - 1)
    return torch.get_num_threads()


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype):
    """Load the Hugging Face causal LM from ``model_dir`` (safetensors only, no remote code)."""
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_arg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), trust_remote_code=False, use_safetensors=True, **{dtype_arg: dtype})
    return model.to(device).eval()


class Engine(Scheduler, GraphSteps):
    """Runs generation for submitted sequences on a background thread; whom each step admits is ``Scheduler``'s,
    the steps through the CUDA-graph decoder are ``GraphSteps``'."""

    def __init__(self, model, limits: Limits, *, max_rows: int = 8, max_prefill_tokens: int = 8192,
                 cancel_check_ms: float = 20.0, log: Callable[[str], None] = print):
        self.model = model
        self.limits = limits
        self.max_rows = max(1, max_rows)
        self.max_prefill_tokens = max(1, max_prefill_tokens)
        self.cancel_check_s = cancel_check_ms / 1000.0
        self.log = log
        self.device = next(model.parameters()).device
        if self.device.type == "cuda" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            # With a padding mask, half-precision SDPA picks cuDNN attention, which builds a new plan
            # for every KV length, i.e. every step (~15 ms of CPU each on an H100); the
            # memory-efficient kernel has no such cost.
            torch.backends.cuda.enable_cudnn_sdp(False)
        params = inspect.signature(model.forward).parameters
        self._keep_arg = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
        self._cache_position = "cache_position" in params
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers ≥ 5.x: ``cache``
        self.vocab = model.get_input_embeddings().num_embeddings  # prompt ids from here on select prompt-table rows
        self._pending: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._admitting: list[Sequence] = []  # taken from the queue by this step, until its prefill has run
        self._batch = None  # kvcache.BatchCache of the Hugging Face forward's rows (no static decoder)
        self._cond = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._last_cancel_check = 0.0
        self.steps = 0
        self.step_ns = 0  # time inside ``step`` (the rest of the engine thread's time it waits for work)
        self.decoded_rows = 0  # rows summed over decoding steps (÷ decoding steps: the mean batch)
        self.decode_steps = 0
        self.prefill_ns = 0  # time inside prefills (part of step_ns; not the step in flight settled before one)
        self.prefills = 0  # prefills run
        self.admitted = 0  # sequences admitted, and their waits from submit to admission summed:
        self.queued_ns = 0  # queued_ns / admitted is the mean wait in the engine's queue
        # Decoding steps through CUDA graphs on a GPU only (``timed``): the device's time in them (CUDA events)
        # and the engine thread's wait for their tokens (the device's time after the launch, and the GIL taken back)
        self.device_ns = 0
        self.wait_ns = 0
        self._events: tuple | None = None
        # Decoding steps launched one ahead (use_graphs' ``overlap``): while the device runs a step, the host reads
        # the one before and reports its tokens, so between decoding steps the device does not wait for the host
        # (nor for another thread holding the GIL); an admission still reads the step in flight first. Plain greedy
        # rows only; anything else runs one step at a time.
        self.overlap = False
        self._ahead = None  # the step in flight (graph_steps._Ahead)
        self._buffers: list = []  # two (host picks, step's events) pairs that launches alternate
        self._turn = 0
        self.lora = None  # lora.LoraModules when the model serves LoRA adapters: each row's adapter per step
        self.on_step: Callable[[], None] | None = None  # the engine thread calls it after each step and at its end
        self.graphs: graphs.GraphDecoder | None = None  # decoding steps as CUDA graphs (use_graphs)
        self.admit_wait_ns = int(ADMIT_WAIT_S * 1e9) if self.device.type == "cuda" else 0  # see ADMIT_SHARE
        self.reduce = None  # a tensor-parallel rank's all-reduce, for the CUDA-graph decoder (distributed.py)

    # -- public, thread-safe ----------------------------------------------------------------------
    def start(self) -> "Engine":
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="forge-decoder", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Ask the engine thread to stop (it fails what is left) and wait up to ``timeout`` s; whether it ended.

        The thread is a daemon: one still inside a long step never keeps the process alive.
        """
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            return not self._thread.is_alive()
        return True

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue sequences; their callbacks run on the engine thread."""
        for seq in sequences:
            self._prepare(seq)
            seq.arrival_step = self.decode_steps
        with self._cond:
            self._pending.extend(sequences)
            self._cond.notify_all()

    @property
    def timed(self) -> bool:
        """Whether ``device_ns`` and ``wait_ns`` are measured (CUDA graphs on a GPU)."""
        return self._events is not None

    @property
    def busy(self) -> int:
        """Sequences waiting or running: one in its prefill counts, a finished one still in the batch until the
        step ends does not (read from any thread)."""
        with self._cond:  # the queue and the admission taken from it, as one
            waiting, admitting = len(self._pending), list(self._admitting)
        rows = list(self._active)  # after the admission: a sequence leaves it only once it is in the batch
        batched = {id(s) for s in rows}
        return waiting + sum(not s.finished for s in rows) + sum(
            not s.finished and id(s) not in batched for s in admitting)

    @property
    def waiting(self) -> int:
        """Sequences submitted and not admitted to the decoding batch yet (part of ``busy``)."""
        return len(self._pending)

    # -- the loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while self._running and not self._pending and not self._active:
                        self._cond.wait()
                    if not self._running:
                        break
                try:
                    self.step()
                except Exception as exc:  # keep serving everyone else; fail who was in the step
                    self.log(f"forge decoder step failed: {traceback.format_exc()}")
                    self._fail_all(f"generation failed: {type(exc).__name__}: {exc}")
                if self.on_step is not None:
                    self.on_step()
        self._fail_all("the model is being unloaded", pending=True)
        if self.on_step is not None:
            self.on_step()

    @torch.inference_mode()
    def step(self) -> None:
        """One iteration: cancellations, admissions (prefill), one decoding step (no autograd, whoever calls it:
        a pick copied into the pinned host buffers must not carry a graph)."""
        started = time.perf_counter_ns()
        self._check_cancelled()
        admitted = self._admit()
        if admitted:
            # the step in flight reports first: a prefill reads back its own tokens at once (that wait counts
            # as wait_ns, and the report is decoding work: neither is the prefill's time)
            self._settle()
            begun = time.perf_counter_ns()
            self.admitted += len(admitted)
            self.prefills += 1
            now = time.time_ns()
            self.queued_ns += sum(now - s.arrival_ns for s in admitted)
            self._prefill(admitted)
            self.prefill_ns += time.perf_counter_ns() - begun
            self._admitting = []
        if self._active:
            self.decoded_rows += len(self._active)
            self.decode_steps += 1
            self._decode()
        if not self._active:
            self._settle()
        self.steps += 1
        self.step_ns += time.perf_counter_ns() - started

    def run_until_idle(self, max_steps: int = 100000) -> None:
        """Run steps on the calling thread until nothing is left (for tests and offline use)."""
        with torch.inference_mode():
            for _ in range(max_steps):
                if not self._pending and not self._active:
                    return
                self.step()

    # -- internals ----------------------------------------------------------------------------------
    def _prepare(self, seq: Sequence) -> None:
        req = seq.request
        seq.tokens = list(req.prompt)
        seq.top_p = req.sampling.top_p
        if not req.sampling.greedy:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(req.sampling.seed & 0xFFFF_FFFF_FFFF_FFFF)
        if req.embedding_bias is not None:
            seq.bias = torch.as_tensor(req.embedding_bias, dtype=torch.float32, device=self.device)
        if req.grammar is not None:
            seq.matcher = guided.Matcher(req.grammar, req.end_id)

    def _tabled(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt holds ids past the vocabulary (its prefill embeds them: ``_embed``)."""
        return max(seq.tokens, default=0) >= self.vocab

    def _embed(self, ids: torch.Tensor, admitted: list[Sequence]) -> torch.Tensor | None:
        """Input embeddings when a prompt holds ids past the vocabulary (None: plain ids will do); ``ids`` on the
        host.

        Such ids select rows of the request's prompt table, or embed as zeros without one (see request.py).
        """
        if not any(self._tabled(seq) for seq in admitted):
            return None
        table = self.model.get_input_embeddings()
        vocab = self.vocab
        ids = ids.to(self.device)
        outside = ids >= vocab
        embeds = table(torch.where(outside, torch.zeros_like(ids), ids))
        embeds = embeds.masked_fill(outside.unsqueeze(-1), 0.0)
        for i, seq in enumerate(admitted):
            rows = seq.request.prompt_table
            if rows is not None and bool(outside[i].any()):
                rows = torch.as_tensor(rows, dtype=embeds.dtype, device=embeds.device)
                embeds[i, outside[i]] = rows[ids[i, outside[i]] - vocab]
        return embeds

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
                 keep_all: bool = False, embeds: torch.Tensor | None = None,
                 rows: list[Sequence] | None = None) -> torch.Tensor:
        if self.lora is not None:
            self.lora.select([s.request.lora for s in rows or ()])
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": positions, self._cache_arg: cache,
                                  "use_cache": True}
        if embeds is None:
            kwargs["input_ids"] = ids
        else:
            kwargs["inputs_embeds"] = embeds
        if self._keep_arg and not keep_all:
            kwargs[self._keep_arg] = 1
        if self._cache_position:
            past = mask.shape[1] - ids.shape[1]
            kwargs["cache_position"] = torch.arange(past, mask.shape[1], device=self.device)
        return self.model(**kwargs).logits

    def _prefill(self, admitted: list[Sequence]) -> None:
        scheduled = time.time_ns()
        for seq in admitted:
            seq.scheduled_ns = scheduled
        if self.graphs is not None:
            self._prefill_static(admitted)
            return
        from . import kvcache  # transformers' cache classes: only the Hugging Face forward needs them

        lengths = [len(s.tokens) for s in admitted]
        width = max(lengths)
        ids = torch.zeros((len(admitted), width), dtype=torch.long)
        mask = torch.zeros((len(admitted), width), dtype=torch.long)
        for i, seq in enumerate(admitted):
            ids[i, width - lengths[i]:] = torch.tensor(seq.tokens)
            mask[i, width - lengths[i]:] = 1
        embeds = self._embed(ids, admitted)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = kvcache.new_cache()
        keep_all = any(toplogprobs.all_logits(s) for s in admitted)
        try:
            logits = self._forward(ids, mask, positions, cache, keep_all=keep_all, embeds=embeds, rows=admitted)
        except Exception as exc:
            self._prefill_failed(admitted, exc)
            return
        if keep_all:
            for i, seq in enumerate(admitted):
                toplogprobs.keep_prompt(seq, logits[i, width - lengths[i]:])
        batch = kvcache.BatchCache(cache, mask)
        if self._batch is None or not self._active:
            self._batch = batch
        else:
            self._batch.merge(batch)
        self._active.extend(admitted)
        self._advance(logits[:, -1, :], admitted)

    def _prefill_failed(self, admitted: list[Sequence], exc: Exception) -> None:
        self.log(f"forge decoder prefill failed: {traceback.format_exc()}")
        for seq in admitted:
            self._finish(seq, Update([], [], [], True, "error", f"generation failed: {exc}"))

    def _decode(self) -> None:
        if self._overlappable():
            self._decode_ahead()
            return
        self._settle()
        if self.graphs is not None:
            self._decode_graphs()
            return
        ids = torch.tensor([[s.tokens[-1]] for s in self._active], dtype=torch.long, device=self.device)
        mask = self._batch.extend_mask()
        positions = (mask.sum(-1, keepdim=True) - 1)
        logits = self._forward(ids, mask, positions, self._batch.cache, rows=self._active)
        self._advance(logits[:, -1, :], self._active)

    def _advance(self, logits: torch.Tensor | None, rows: list[Sequence],
                 chosen: tuple[list[int], list[float]] | None = None) -> None:
        """Pick one token per row (unless ``chosen`` already holds them), report it, and drop the rows that
        finished. ``logits`` None: ``chosen`` is what a launched step picked (``_report``)."""
        if chosen is None and any(s.matcher is not None for s in rows):  # only what each row's grammar allows
            tokens, logprobs = sampling.choose(guided.mask(logits, [s.matcher for s in rows]), rows)
        else:
            tokens, logprobs = chosen or sampling.choose(logits, rows)
        want_logits = logits is not None and any(s.request.return_generation_logits for s in rows)
        raw = logits.float().cpu().numpy() if want_logits else None
        tops = toplogprobs.chosen(logits, rows, tokens)
        now = time.time_ns()
        for i, (seq, token, logprob) in enumerate(zip(rows, tokens, logprobs)):
            req = seq.request
            seq.generated += 1
            if not seq.first_token_ns:
                seq.first_token_ns = now
            seq.last_token_ns = now
            if req.end_id is not None and token == req.end_id:
                # TensorRT-LLM stops at end_id and leaves it out of the output
                self._finish(seq, Update([], [], [], True, "end_id"))
                continue
            if seq.matcher is not None:
                if not seq.matcher.accept(token):  # every token was banned (the grammar vs bad_words/min_length)
                    self._finish(seq, Update([], [], [], True, "error", "guided decoding: no token satisfies both "
                                             "the guide and the request's bad_words/min_length here"))
                    continue
                if seq.matcher.ended:  # its stop token ended the guide: finish as at end_id, the token left out
                    self._finish(seq, Update([], [], [], True, "end_id"))
                    continue
            seq.tokens.append(token)
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.cum_logprob += logprob
            gen_logits = [raw[i]] if raw is not None and req.return_generation_logits else []
            seq.generation_logits.extend(gen_logits)
            top = [tops[i]] if tops.get(i) is not None else []
            seq.top.extend(top)
            reason = None
            if seq.generated >= req.max_new_tokens:
                reason = "length"
            elif any(len(w) <= len(seq.output) and seq.output[-len(w):] == w for w in req.stop_words):
                reason = "stop_words"
            if reason:
                self._finish(seq, Update([token], [logprob], gen_logits, True, reason, top=top))
            else:
                self._emit(seq, Update([token], [logprob], gen_logits, False, top=top))
        self._drop_finished()

    def _emit(self, seq: Sequence, update: Update) -> None:
        try:
            seq.on_update(seq, update)
        except Exception:  # an owner's failure must not stop the batch
            self.log(f"forge decoder callback failed: {traceback.format_exc()}")
            seq.cancelled = True

    def _finish(self, seq: Sequence, update: Update) -> None:
        if seq.finished:
            return
        seq.finished = True
        self._emit(seq, update)

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self._active) if not s.finished]
        if len(keep) == len(self._active):
            return
        if self.graphs is not None:  # the rows past the new end fill the holes: the fewest slots move
            keep = filled_holes(keep)
            self.graphs.keep(keep)
        elif keep:
            self._batch.select(keep)
        else:
            self._batch = None
        self._active = [self._active[i] for i in keep]

    def _fail_all(self, message: str, pending: bool = False) -> None:
        victims = list(self._active)
        if pending:
            with self._cond:
                victims += list(self._pending)
                self._pending.clear()
        for seq in victims:
            self._finish(seq, Update([], [], [], True, "error", message))
        self._active, self._batch, self._ahead, self._admitting = [], None, None, []
        if self.graphs is not None:
            self.graphs.reset()
