"""Continuous batching over a Hugging Face causal LM: sequences join and leave between steps.

One thread owns the model. Each iteration it admits waiting sequences (one batched, left-padded
prefill), merges their KV caches into the running batch, runs one decoding step for every
running sequence, reports new tokens through each sequence's callback and drops the finished
ones. Sequences of different prompt lengths, output lengths and sampling parameters share steps.
Through CUDA graphs the decoding steps of plain greedy rows overlap (``Engine.overlap``): a step is
launched before the host has read the one before it.
"""

from __future__ import annotations

import inspect
import math
import os
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import graphs, guided, kvcache, sampling
from .request import GenerationRequest, Limits

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Update:
    """What one step produced for one sequence."""

    tokens: list[int]
    logprobs: list[float]
    generation_logits: list[np.ndarray]
    finished: bool
    reason: str | None = None  # "length", "end_id", "stop_words", "cancelled", "error"
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    """A sequence being generated: its request, its owner's callback and its state."""

    request: GenerationRequest
    on_update: Callable[["Sequence", Update], None]
    is_cancelled: Callable[[], bool] = lambda: False
    owner: Any = None
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    output: list[int] = field(default_factory=list)  # generated tokens reported to the owner
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0  # sum of ``logprobs``
    context_logits: np.ndarray | None = None
    generation_logits: list[np.ndarray] = field(default_factory=list)
    generator: torch.Generator | None = None
    top_p: float = 0.0
    bias: torch.Tensor | None = None
    matcher: guided.Matcher | None = None  # where the request's guide has got to (guided decoding only)
    cancelled: bool = False
    finished: bool = False
    arrival_ns: int = field(default_factory=time.time_ns)
    arrival_step: int = 0  # the engine's decoding steps when it was submitted
    scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0

    def cancel(self) -> None:
        """Ask the engine to stop this sequence at its next step (thread-safe)."""
        self.cancelled = True


@dataclass(eq=False)
class _Ahead:
    """A decoding step launched before the host read the one before it (``Engine.overlap``), and the prompts
    admitted since, whose prefill the device runs after it (``joined``: their first tokens follow its picks)."""

    rows: list[Sequence]  # its rows in slot order, then the joined prompts'
    padding: set[int]  # rows decoded as padding: their sequences end with the step before (or were cancelled)
    picks: torch.Tensor  # the device's [rows, 2] picks, what the next step's tokens are gathered from
    host: torch.Tensor  # ... copied to pinned memory
    events: tuple | None  # (launched, done) CUDA events of the step (None on a CPU, or a prefill alone)
    ready: Any = None  # the CUDA event after the joined prompts' picks are copied too
    joined: int = 0  # rows at the end that a prefill added


def filled_holes(live: list[int]) -> list[int]:
    """The order of the surviving rows ``live`` (ascending) once packed to the front: a row already within the
    first ``len(live)`` stays where it is, and the rows past them move into the holes of the finished ones."""
    n = len(live)
    stay = {row for row in live if row < n}
    tail = iter(row for row in live if row >= n)
    return [slot if slot in stay else next(tail) for slot in range(n)]


def choose_device(name: str = "auto") -> torch.device:
    if name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


#: On a GPU a prefill keeps the device busy about as long as a decoding step whatever its size (H100, SmolLM2
#: shape: 1.23 ms for one 32-token prompt, 1.61 for 16, against 1.06 for a 64-row step), so while sequences run,
#: arrivals are gathered: admitted once len(running) // ADMIT_SHARE are waiting, the oldest has waited
#: ADMIT_WAIT_STEPS decoding steps (a streamed one, whose client watches for the first token: ADMIT_WAIT_S), or
#: nothing runs. Free slots do not cap the count waited for: at c=64 one or two free up per step, and admitting
#: them at once made nearly every prefill one of one or two prompts. H100, SmolLM2 shape, served c=16 / 64:
#: 4 steps gave 9 400 / 23 850 tok/s against 8 670 / 22 160 (8.9 prompts a prefill, prefill share 0.36 → 0.17);
#: 8 steps measured 8 800 / 22 340 in another call. 2 ms against 8 gave a streamed c=16 time to first token p50 of
#: 28 ms against 38 (H200, streamed steps overlapped then).
ADMIT_SHARE = 4
ADMIT_WAIT_S = 0.002
ADMIT_WAIT_STEPS = 4
#: Whether prefills join the step in flight where they can (``Engine._joins``) instead of waiting for it. Off: on
#: an H100 (SmolLM2 shape, 16 sequences arriving a few ms apart) a joined prefill hit a device-side index error
#: within seconds. The cause, fixed since but not run on a GPU again: the captured graphs share one memory pool,
#: so a step graph's picks read after a prefill graph had run could be that graph's scratch (GraphDecoder.prefill
#: now copies them first; tests/serve/test_graphs.py stands the pool in on the CPU, where the same mistake is an
#: embedding IndexError). With whole waves of arrivals (64 prompts a prefill) joining changed nothing (55 405
#: tok/s against 55 845). Tests and benchmarks/serve_gpu.py --closed-loop turn it on.
JOIN_PREFILLS = False
GPU_ROWS = 64  # sequences in flight on a GPU by default: one decode step costs about the same at 1 and 64 rows
#: The share of the free GPU memory the CUDA-graph decoder's KV cache may take when
#: -o kv_cache_free_gpu_mem_fraction is not set (the rest: activations, graphs, the other models).
DEFAULT_KV_FRACTION = 0.5


def choose_rows(device: torch.device, requested: int, max_batch_size: int) -> int:
    """Sequences decoded together: ``requested`` when > 0, else (auto) ``max_batch_size`` on a CPU, where a
    step's cost grows with its rows, and at least GPU_ROWS on a GPU, where it hardly does (H100, SmolLM2
    shape: 27 ms/step at 1 row and 28 at 64; with 8 rows the server flattened at 258 tok/s, with 64 it
    served 1508). Triton's max_batch_size still bounds the rows of one request."""
    if requested > 0:
        return requested
    return max(max_batch_size, GPU_ROWS) if device.type == "cuda" else max_batch_size


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


class Engine:
    """Runs generation for submitted sequences on a background thread."""

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
        self.vocab = model.get_input_embeddings().num_embeddings  # prompt ids from here on select prompt-table rows
        self._pending: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._batch: kvcache.BatchCache | None = None
        self._cond = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._last_cancel_check = 0.0
        self.steps = 0
        self.step_ns = 0  # time inside ``step`` (the rest of the engine thread's time it waits for work)
        self.decoded_rows = 0  # rows summed over decoding steps (÷ decoding steps: the mean batch)
        self.decode_steps = 0
        self.prefill_ns = 0  # time inside prefills (part of step_ns; not the step in flight settled before one)
        self.prefills = 0  # prefills run, and of them those that joined the step in flight (``_joins``)
        self.joined = 0
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
        self._ahead: _Ahead | None = None
        self._buffers: list = []  # two (host picks, step's events, joined prefill's event) sets that launches alternate
        self._turn = 0
        self.lora = None  # lora.LoraModules when the model serves LoRA adapters: each row's adapter per step
        self.on_step: Callable[[], None] | None = None  # the engine thread calls it after each step and at its end
        self.graphs: graphs.GraphDecoder | None = None  # decoding steps as CUDA graphs (use_graphs)
        self.admit_wait_ns = int(ADMIT_WAIT_S * 1e9) if self.device.type == "cuda" else 0  # see ADMIT_SHARE
        self.reduce = None  # a tensor-parallel rank's all-reduce, for the CUDA-graph decoder (distributed.py)

    def use_graphs(self, mode: str = "auto", *, capture: bool = True, compile: str = "auto", paged: str = "auto",
                   reuse: bool = False, memory_fraction: float | None = None, blocks: int | None = None,
                   overlap: str = "auto") -> str:
        """Decode through ``graphs.GraphDecoder`` (``-o cuda_graphs``); returns what was chosen, for the log.

        ``auto``: on a GPU where the model allows it (a Llama-style or GPT-2 model, its KV cache for every row at
        max_seq_len within half the free GPU memory; steps with a LoRA adapter in the batch run eagerly);
        ``true``: the same or an error saying why not; ``false``: the Hugging Face forward; anything else is an
        error. ``compile``: ``-o torch_compile`` for the static decoder's layers (``GraphDecoder.use_compile``);
        ``true`` needs the static decoder. ``paged`` (``-o paged_kv_cache``): ``auto`` keeps a static slot per row
        where that fits ``memory_fraction`` of the free GPU memory (``-o kv_cache_free_gpu_mem_fraction``,
        default 0.5) and takes blocks of a pool sized by that memory otherwise; ``true`` always blocks,
        ``false`` never. ``reuse`` (``-o enable_kv_cache_reuse``) shares full prompt blocks between sequences:
        blocks. ``blocks``: the pool's size instead of the memory's (tests). ``overlap`` (``-o overlap_steps``):
        ``auto`` launches each decoding step before the host has read the last one where the steps are captured
        on a GPU with static slots (at any tp: the followers gather their tokens from their own picks too);
        ``true``: wherever the decoder has static slots (eagerly on a CPU: what the tests check), or an error;
        ``false``: never (see ``overlap``). Call before ``start`` and after ``lora``.
        """
        overlap = graphs.mode_of("overlap_steps", overlap)
        mode = graphs.mode(mode)
        compile = graphs.mode_of("torch_compile", compile)
        paged = graphs.mode_of("paged_kv_cache", paged)
        if paged == "false" and reuse:
            raise ValueError("-o enable_kv_cache_reuse=true shares blocks of a paged KV cache; it needs "
                             "-o paged_kv_cache=auto or true")
        asked = [option for option, value in (("torch_compile", compile), ("paged_kv_cache", paged),
                                              ("overlap_steps", overlap)) if value == "true"]
        if mode == "false":
            if asked:
                raise ValueError(f"-o {asked[0]}=true belongs to the CUDA-graph decoder; it needs "
                                 "-o cuda_graphs=auto or true")
            return "off (-o cuda_graphs=false)"
        reason = graphs.unsupported(self.model, self.limits.max_seq_len)
        if reason is None and capture and self.device.type != "cuda":
            reason = f"the model runs on {self.device.type}, not a GPU"
        layout = None
        if reason is None:
            layout, reason = self._layout(paged, reuse, memory_fraction, blocks)
        if reason is not None:
            if mode == "true":
                raise ValueError(f"-o cuda_graphs=true: cannot decode through CUDA graphs: {reason}")
            if asked:
                raise ValueError(f"-o {asked[0]}=true: the CUDA-graph decoder is off: {reason}")
            return f"off ({reason})"
        self.graphs = graphs.decoder_for(self.model, self.max_rows, self.limits.max_seq_len, capture=capture,
                                         paged=layout, reduce=self.reduce)
        self.graphs.log = self.log
        if self.graphs.capture:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        compiled = self.graphs.use_compile(compile)
        overlapped = self._use_overlap(overlap)
        return (f"on ({self.graphs.describe()}; torch.compile {compiled}; {overlapped})" if self.graphs.capture
                else f"{self.graphs.describe()}, eager (no capture; torch.compile {compiled}"
                     f"{'; ' + overlapped if self.overlap else ''})")

    def _use_overlap(self, mode: str) -> str:
        """``use_graphs``' ``overlap``: on, or off and why (for the log), or the error saying why it cannot be."""
        reason = "the KV cache is paged" if self.graphs.cache.paged else None
        if mode == "true" and reason:
            raise ValueError(f"-o overlap_steps=true: {reason}")
        self.overlap = mode == "true" or (mode == "auto" and self.graphs.capture and reason is None)
        if self.overlap:
            gpu = self.graphs.capture
            # a step's rows and the prompts joining them can hold up to twice the rows (the step's rows that have
            # finished are still in it)
            self._buffers = [(torch.zeros((2 * self.max_rows, 2), dtype=torch.float32, pin_memory=gpu),
                              (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                              if gpu else None, torch.cuda.Event() if gpu else None)
                             for _ in range(2)]
            return "steps overlapped"
        return f"steps one at a time ({'-o overlap_steps=false' if mode == 'false' else reason})"

    def _layout(self, paged: str, reuse: bool, fraction: float | None,
                blocks: int | None) -> tuple[dict | None, str | None]:
        """(paged layout or None for static slots, why neither fits) for use_graphs."""
        rows, max_len = self.max_rows, self.limits.max_seq_len
        static = graphs.cache_bytes(self.model, rows, max_len)
        budget = None
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * (fraction or DEFAULT_KV_FRACTION))
        if paged == "false" or (paged == "auto" and not reuse and (budget is None or static <= budget)):
            if budget is not None and static > budget:
                return None, (f"a static KV cache for {rows} rows × {max_len} tokens needs {static / 2**30:.1f} GiB, "
                              f"more than {budget / 2**30:.1f} GiB of free GPU memory it may take; lower "
                              "-o inflight_sequences or --max-seq-len, or let -o paged_kv_cache=auto page it")
            return None, None
        block = graphs.BLOCK_TOKENS
        full = rows * math.ceil(max_len / block)  # every row at max_len: more never helps
        if blocks is None:
            blocks = full if budget is None else min(full, budget // graphs.block_bytes(self.model, block))
        if blocks < math.ceil(max_len / block):
            return None, (f"a paged KV cache in {budget / 2**30 if budget else 0:.1f} GiB holds {blocks} blocks of "
                          f"{block} tokens, fewer than one {max_len}-token sequence needs; lower --max-seq-len or "
                          "raise -o kv_cache_free_gpu_mem_fraction")
        return {"block": block, "blocks": blocks, "reuse": reuse}, None

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
        """Sequences waiting or running (a finished one still in the batch until the step ends is not)."""
        return len(self._pending) + sum(not s.finished for s in list(self._active))

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
            join = self._joins(admitted)
            if not join:
                # the step in flight reports first: a prefill reads back its own tokens at once (that wait counts
                # as wait_ns, and the report is decoding work: neither is the prefill's time)
                self._settle()
            begun = time.perf_counter_ns()
            self.admitted += len(admitted)
            self.prefills += 1
            self.joined += len(admitted) if join else 0
            now = time.time_ns()
            self.queued_ns += sum(now - s.arrival_ns for s in admitted)
            self._prefill(admitted, join)
            self.prefill_ns += time.perf_counter_ns() - begun
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

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_check < self.cancel_check_s:
            return
        self._last_cancel_check = now
        with self._cond:
            waiting = list(self._pending)
        for seq in waiting + self._active:
            if not seq.cancelled:
                try:
                    seq.cancelled = bool(seq.is_cancelled())
                except Exception:  # the owner went away: nobody wants the result
                    seq.cancelled = True
        gone = [s for s in waiting if s.cancelled]
        if gone:
            with self._cond:
                for seq in gone:
                    if seq in self._pending:
                        self._pending.remove(seq)
            for seq in gone:
                self._finish(seq, Update([], [], [], True, "cancelled"))
        if any(s.cancelled for s in self._active):
            self._settle()  # what the step in flight made for them is reported first, as without overlap
            for seq in self._active:
                if seq.cancelled:
                    self._finish(seq, Update([], [], [], True, "cancelled"))
            self._drop_finished()

    def _gathering(self) -> bool:
        """Whether waiting sequences wait for more to join them in one prefill (see ADMIT_SHARE)."""
        if not self.admit_wait_ns or not self._active or not self._pending:
            return False
        if len(self._pending) >= max(1, len(self._active) // ADMIT_SHARE):
            return False
        oldest = self._pending[0]
        if oldest.request.streaming:  # its client waits for the first token
            return time.time_ns() - oldest.arrival_ns < self.admit_wait_ns
        return self.decode_steps - oldest.arrival_step < ADMIT_WAIT_STEPS

    def _need(self, seq: Sequence) -> int:
        """The most tokens ``seq`` can come to hold (what a paged cache promises it at admission)."""
        return min(len(seq.tokens) + seq.request.max_new_tokens, self.limits.max_seq_len)

    def _admit(self) -> list[Sequence]:
        free = self.max_rows - len(self._active)
        admitted: list[Sequence] = []
        needs: list[int] = []  # each admitted sequence's _need, what a paged cache checks and promises
        longest = 0
        if self._gathering():
            return admitted
        with self._cond:
            while self._pending and len(admitted) < free:
                seq = self._pending[0]
                if seq.cancelled:
                    self._pending.popleft()
                    self._finish(seq, Update([], [], [], True, "cancelled"))
                    continue
                width = max(longest, len(seq.tokens))
                if admitted and width * (len(admitted) + 1) > self.max_prefill_tokens:
                    break
                need = self._need(seq)
                room = True if self.graphs is None or not self.graphs.cache.paged else self.graphs.room(needs + [need])
                if room is None:  # more than the whole pool: it would wait forever
                    self._pending.popleft()
                    self._finish(seq, Update([], [], [], True, "error", (
                        f"the request may reach {need} tokens, more than the paged KV cache holds "
                        f"({self.graphs.cache.blocks} blocks of {self.graphs.cache.block} tokens); lower its "
                        "max_tokens, or raise -o kv_cache_free_gpu_mem_fraction")))
                    continue
                if not room:  # blocks free up as running sequences finish
                    break
                longest = width
                needs.append(need)
                admitted.append(self._pending.popleft())
        return admitted

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
        kwargs: dict[str, Any] = dict(attention_mask=mask, position_ids=positions,
                                      past_key_values=cache, use_cache=True)
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

    def _joins(self, admitted: list[Sequence]) -> bool:
        """Whether the prefill of ``admitted`` may join the step in flight (or start one where nothing runs):
        launched without reading that step first, their first tokens read with its picks, the next step gathering
        every row's token on the device. With JOIN_PREFILLS, where steps overlap and every prompt is plain (what
        ``_overlappable`` asks, no context logits, no prompt table). Otherwise a prefill waits for the step in
        flight and reads its own first tokens back, the device idle meanwhile."""
        return (JOIN_PREFILLS and self.overlap and (self._ahead is not None or not self._active)
                and all(self._overlaps(s, first=True) and not s.request.return_context_logits and not self._tabled(s)
                        for s in admitted))

    def _prefill(self, admitted: list[Sequence], join: bool = False) -> None:
        scheduled = time.time_ns()
        for seq in admitted:
            seq.scheduled_ns = scheduled
        if self.graphs is not None:
            self._prefill_static(admitted, join)
            return
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
        keep_all = any(s.request.return_context_logits for s in admitted)
        try:
            logits = self._forward(ids, mask, positions, cache, keep_all=keep_all, embeds=embeds, rows=admitted)
        except Exception as exc:
            self._prefill_failed(admitted, exc)
            return
        for i, seq in enumerate(admitted):
            if seq.request.return_context_logits:
                seq.context_logits = logits[i, width - lengths[i]:].float().cpu().numpy()
        batch = kvcache.BatchCache(cache, mask)
        if self._batch is None or not self._active:
            self._batch = batch
        else:
            self._batch.merge(batch)
        self._active.extend(admitted)
        self._advance(logits[:, -1, :], admitted)

    def _prefill_static(self, admitted: list[Sequence], join: bool = False) -> None:
        """The admitted prompts through the static decoder's own prefill (right-padded, keys and values straight
        into their slots); plain greedy rows take the argmax it computed. ``join``: see ``_joins``."""
        lengths = [len(s.tokens) for s in admitted]
        table = np.zeros((len(admitted), max(lengths)), dtype=np.int64)
        for i, seq in enumerate(admitted):
            table[i, :lengths[i]] = seq.tokens
        ids = torch.from_numpy(table)  # on the host: the decoder uploads it without waiting for the device
        if join:
            self._prefill_joined(admitted, ids, lengths)
            return
        keep_all = any(s.request.return_context_logits for s in admitted)
        adapters = self.lora is not None and any(s.request.lora is not None for s in admitted)
        if self.lora is not None:
            self.lora.select([s.request.lora for s in admitted] if adapters else None)
        embeds = self._embed(ids, admitted)
        shared = self.graphs.cache.paged and self.graphs.cache.reuse and embeds is None and not keep_all \
            and not adapters
        try:
            logits = self.graphs.prefill(ids, lengths, embeds=embeds, all_logits=keep_all, modules=adapters,
                                         needs=[self._need(s) for s in admitted],
                                         prompts=[list(s.tokens) for s in admitted] if shared else None,
                                         banned=[sampling.banned_end(s) for s in admitted])
        except Exception as exc:
            self._prefill_failed(admitted, exc)
            return
        if keep_all:
            for i, seq in enumerate(admitted):
                if seq.request.return_context_logits:
                    seq.context_logits = logits[i, :lengths[i]].float().cpu().numpy()
            logits = logits[torch.arange(len(admitted), device=self.device),
                            torch.tensor(lengths, device=self.device) - 1]
        self._active.extend(admitted)
        plain = all(sampling.plain_greedy(s, end_banned=True) for s in admitted)  # the picks left banned ends out
        self._advance(logits, admitted, self.graphs.greedy(len(admitted)) if plain else None)

    def _prefill_joined(self, admitted: list[Sequence], ids: torch.Tensor, lengths: list[int]) -> None:
        """Launch the prefill after the step in flight (``_joins``): its picks join that step's, copied to the same
        pinned buffer behind them; the rows are read and reported with that step."""
        prev = self._ahead
        after = len(prev.rows) if prev is not None else 0
        if self.lora is not None:
            self.lora.select(None)
        try:
            self.graphs.prefill(ids, lengths, needs=[self._need(s) for s in admitted], after=after,
                                banned=[sampling.banned_end(s) for s in admitted])
        except Exception as exc:
            self._prefill_failed(admitted, exc)
            return
        if prev is None:  # nothing in flight: the prefill's picks are read as a launched step's would be
            host, _events, ready = self._buffers[self._turn]
            self._turn ^= 1
            prev = _Ahead([], set(), self.graphs.picks, host, None, ready)
        n = len(admitted)
        picks = self.graphs.picks
        prev.host[after:after + n].copy_(picks[after:after + n], non_blocking=True)
        if prev.ready is not None:
            prev.ready.record()
        self._active.extend(admitted)
        self._ahead = _Ahead(prev.rows + admitted, prev.padding, picks, prev.host, prev.events, prev.ready,
                             prev.joined + n)

    def _prefill_failed(self, admitted: list[Sequence], exc: Exception) -> None:
        self.log(f"forge decoder prefill failed: {traceback.format_exc()}")
        for seq in admitted:
            self._finish(seq, Update([], [], [], True, "error", f"generation failed: {exc}"))

    def _overlappable(self) -> bool:
        """Whether this step may be launched before the host reads the last one: every row ``_overlaps``. With a
        step (or a joined prefill) in flight, each row's token there is not counted yet: this step picks the one
        after it, which min_length's ban of the end_id may no longer reach."""
        ahead = self._ahead is not None
        return self.overlap and all(self._overlaps(s, first=ahead) for s in self._active)

    def _overlaps(self, seq: Sequence, first: bool = False) -> bool:
        """Whether ``seq``'s steps may overlap: its token is the argmax the graph picks, nothing else is read back
        from the step (no generation logits), no adapter runs, and it does not stream. A streaming row sends a
        response per token, which keeps the host, not the device, the bottleneck: there overlap gained nothing
        and took time to first token from 14 to 25 ms (H100, SmolLM2 shape, streamed c=16: 2 055 tok/s
        overlapped, 2 109 one step at a time). ``first``: min_length may ban the end_id from its next token alone
        (a prompt's first token, whose pick leaves it out: ``sampling.banned_end``; or the token in flight)."""
        return (sampling.plain_greedy(seq, end_banned=first) and not seq.request.return_generation_logits
                and not seq.request.streaming
                and (self.lora is None or seq.request.lora is None))

    def _decode(self) -> None:
        if self._overlappable():
            self._decode_ahead()
            return
        self._settle()
        if self.graphs is not None:
            adapters = self.lora is not None and any(s.request.lora is not None for s in self._active)
            if adapters:  # this step runs eagerly through the modules, whose hooks add each row's adapter
                self.lora.select([s.request.lora for s in self._active])
            elif self.lora is not None:  # no adapter: hooks a capture runs through must add nothing
                self.lora.select(None)
            events = self._events
            if events:
                events[0].record()
            logits = self.graphs.step([s.tokens[-1] for s in self._active], [len(s.tokens) - 1 for s in self._active],
                                      modules=adapters)
            if events:
                events[1].record()
                self._wait(events)
            plain = all(sampling.plain_greedy(s) for s in self._active)  # the graph picked their tokens already
            self._advance(logits, self._active, self.graphs.greedy(len(self._active)) if plain else None)
            return
        ids = torch.tensor([[s.tokens[-1]] for s in self._active], dtype=torch.long, device=self.device)
        mask = self._batch.extend_mask()
        positions = (mask.sum(-1, keepdim=True) - 1)
        logits = self._forward(ids, mask, positions, self._batch.cache, rows=self._active)
        self._advance(logits[:, -1, :], self._active)

    def _decode_ahead(self) -> None:
        """Launch this step, then read and report the one launched before it (if any) while the device runs it.

        The step's tokens are the last step's picks, gathered on the device (``GraphDecoder.step_after``); a row
        the last step ends (its max_new_tokens reached, or cancelled) is padding in it. A row the last step ends
        by its end_id or a stop word is found only when that step is read: this step's token for it is dropped.
        """
        prev, rows, padding = self._ahead, list(self._active), set()
        host, events, ready = self._buffers[self._turn]
        self._turn ^= 1
        if self.lora is not None:
            self.lora.select(None)
        if events:
            events[0].record()
        if prev is None:
            self.graphs.step([s.tokens[-1] for s in rows], [len(s.tokens) - 1 for s in rows])
        else:
            index = {id(seq): i for i, seq in enumerate(prev.rows)}
            spare = self.graphs.spare
            padding = {i for i, seq in enumerate(rows)
                       if seq.cancelled or seq.generated + 1 >= seq.request.max_new_tokens}
            self.graphs.step_after(prev.picks, [index[id(seq)] for seq in rows],
                                   [spare if i in padding else len(seq.tokens) for i, seq in enumerate(rows)])
        picks = self.graphs.picks
        host[:len(rows)].copy_(picks[:len(rows)], non_blocking=True)
        if events:
            events[1].record()
        self._ahead = _Ahead(rows, padding, picks, host, events, ready)
        if prev is not None:
            self._report(prev)

    def _settle(self) -> None:
        """Read and report the step in flight, if any (before a step that reads its own tokens back)."""
        if self._ahead is not None:
            prev, self._ahead = self._ahead, None
            self._report(prev)

    def _report(self, launched: _Ahead) -> None:
        """Wait for a launched step (without the GIL) and report its tokens (and the joined prompts' first ones)."""
        if launched.events:
            self._wait(launched.events)
        if launched.joined and launched.ready is not None:
            self._wait_for(launched.ready)
        picks = launched.host.numpy()[:len(launched.rows)].tolist()
        live = [(i, seq) for i, seq in enumerate(launched.rows) if not seq.finished and i not in launched.padding]
        if live:
            self._advance(None, [seq for _, seq in live],
                          ([int(picks[i][0]) for i, _ in live], [picks[i][1] for i, _ in live]))

    def _wait(self, events: tuple) -> None:
        """Wait (without the GIL) for the decoding step between ``events`` = (launched, done); count the wait and
        the device's time in the step."""
        self._wait_for(events[1])
        self.device_ns += int(events[0].elapsed_time(events[1]) * 1e6)

    def _wait_for(self, done) -> None:
        """Wait (without the GIL) for the CUDA event ``done``; count the wait."""
        waited = time.perf_counter_ns()
        done.synchronize()
        self.wait_ns += time.perf_counter_ns() - waited

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
            reason = None
            if seq.generated >= req.max_new_tokens:
                reason = "length"
            elif any(len(w) <= len(seq.output) and seq.output[-len(w):] == w for w in req.stop_words):
                reason = "stop_words"
            if reason:
                self._finish(seq, Update([token], [logprob], gen_logits, True, reason))
            else:
                self._emit(seq, Update([token], [logprob], gen_logits, False))
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
        self._active, self._batch, self._ahead = [], None, None
        if self.graphs is not None:
            self.graphs.reset()
