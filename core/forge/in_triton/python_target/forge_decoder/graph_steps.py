"""The engine's steps through the CUDA-graph decoder (graphs.GraphDecoder).

``use_graphs`` chooses the decoder and its KV layout (static slots, or blocks of a paged cache sized by the free
GPU memory); prefills go into its slots (``_prefill_static``); decoding steps replay its graphs, and for plain
greedy rows overlap (``Engine.overlap``): a step is launched before the host has read the one before it, its
tokens gathered from that step's picks on the device.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import architectures, graphs, sampling, toplogprobs
from .sequences import Sequence

#: The share of the free GPU memory (on a CPU: the available host memory) the CUDA-graph decoder's KV cache may
#: take when -o kv_cache_free_gpu_mem_fraction is not set (the rest: activations, graphs, the other models).
DEFAULT_KV_FRACTION = 0.5


def available_host_memory() -> int | None:
    """Bytes of host memory available to new allocations (``MemAvailable``), None where it is unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(eq=False)
class _Ahead:
    """A decoding step launched before the host read the one before it (``Engine.overlap``)."""

    rows: list[Sequence]  # its rows in slot order
    padding: set[int]  # rows decoded as padding: their sequences end with the step before (or were cancelled)
    picks: torch.Tensor  # the device's [rows, 2] picks, what the next step's tokens are gathered from
    host: torch.Tensor  # ... copied to pinned memory
    events: tuple | None  # (launched, done) CUDA events of the step (None on a CPU)


class GraphSteps:
    """The CUDA-graph side of ``engine.Engine`` (its base class): the decoder (``graphs``), the step in flight
    (``_ahead``) and their buffers are the engine's; ``_advance`` and ``_prefill_failed`` report to the owners."""

    def use_graphs(self, mode: str = "auto", *, capture: bool = True, compile: str = "auto", paged: str = "auto",
                   reuse: bool = False, memory_fraction: float | None = None, blocks: int | None = None,
                   overlap: str = "auto") -> str:
        """Decode through ``graphs.GraphDecoder`` (``-o cuda_graphs``); returns what was chosen, for the log.

        ``auto``: where the model allows it (a Llama-style or GPT-2 model, its KV cache for every row at
        max_seq_len within half the free GPU memory, on a CPU half the available host memory; steps with a LoRA
        adapter in the batch run eagerly), captured on a GPU and run eagerly on a CPU (fused q/k/v and gate/up
        GEMMs over static slots: 1.2-1.4x the Hugging Face forward's tokens/s on a 2-core AVX512-BF16 EPYC,
        SmolLM2-135M bf16, 1 to 32 rows); ``true``: captured on a GPU, or an error saying why not;
        ``false``: the Hugging Face forward; anything else is an error. ``compile``: ``-o torch_compile`` for
        the static decoder's layers (``GraphDecoder.use_compile``); ``true`` needs the static decoder. ``paged``
        (``-o paged_kv_cache``): ``auto`` keeps a static slot per row where that fits ``memory_fraction`` of the
        free GPU memory, on a CPU of the available host memory (``-o kv_cache_free_gpu_mem_fraction``,
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
        reason = architectures.unsupported(self.model, self.limits.max_seq_len)
        if capture and self.device.type != "cuda":
            if mode == "auto":  # the same arithmetic, run eagerly: fewer, larger GEMMs than the Hugging Face forward
                capture = False
            elif reason is None:
                reason = f"the model runs on {self.device.type}, not a GPU"
        layout = None
        host = available_host_memory() if self.device.type != "cuda" else None  # sizes the cache and the packing
        if reason is None:
            layout, reason = self._layout(paged, reuse, memory_fraction, blocks, host)
        if reason is not None:
            if mode == "true":
                raise ValueError(f"-o cuda_graphs=true: cannot decode through CUDA graphs: {reason}")
            if asked:
                raise ValueError(f"-o {asked[0]}=true: the CUDA-graph decoder is off: {reason}")
            return f"off ({reason})"
        self.graphs = architectures.decoder_for(self.model, self.max_rows, self.limits.max_seq_len, capture=capture,
                                                paged=layout, reduce=self.reduce,
                                                available=host)
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
            self._buffers = [(torch.zeros((self.max_rows, 2), dtype=torch.float32, pin_memory=gpu),
                              (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                              if gpu else None)
                             for _ in range(2)]
            return "steps overlapped"
        return f"steps one at a time ({'-o overlap_steps=false' if mode == 'false' else reason})"

    def _layout(self, paged: str, reuse: bool, fraction: float | None, blocks: int | None,
                host: int | None) -> tuple[dict | None, str | None]:
        """(paged layout or None for static slots, why neither fits) for use_graphs; ``host``: on a CPU, the
        available host memory (bytes) the cache may take ``fraction`` of."""
        rows, max_len = self.max_rows, self.limits.max_seq_len
        static = architectures.cache_bytes(self.model, rows, max_len)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else host
        budget = None if free is None else int(free * (fraction or DEFAULT_KV_FRACTION))
        memory = "GPU" if self.device.type == "cuda" else "host"
        if paged == "false" or (paged == "auto" and not reuse and (budget is None or static <= budget)):
            if budget is not None and static > budget:
                return None, (f"a static KV cache for {rows} rows × {max_len} tokens needs {static / 2**30:.1f} GiB, "
                              f"more than {budget / 2**30:.1f} GiB of free {memory} memory it may take; lower "
                              "-o inflight_sequences or --max-seq-len, or let -o paged_kv_cache=auto page it")
            return None, None
        block = graphs.BLOCK_TOKENS
        full = rows * math.ceil(max_len / block)  # every row at max_len: more never helps
        if blocks is None:
            blocks = full if budget is None else min(full, budget // architectures.block_bytes(self.model, block))
        if blocks < math.ceil(max_len / block):
            return None, (f"a paged KV cache in {budget / 2**30 if budget else 0:.1f} GiB holds {blocks} blocks of "
                          f"{block} tokens, fewer than one {max_len}-token sequence needs; lower --max-seq-len or "
                          "raise -o kv_cache_free_gpu_mem_fraction")
        return {"block": block, "blocks": blocks, "reuse": reuse}, None

    def _prefill_static(self, admitted: list[Sequence]) -> None:
        """The admitted prompts through the static decoder's own prefill (right-padded, keys and values straight
        into their slots); plain greedy rows take the argmax it computed."""
        lengths = [len(s.tokens) for s in admitted]
        table = np.zeros((len(admitted), max(lengths)), dtype=np.int64)
        for i, seq in enumerate(admitted):
            table[i, :lengths[i]] = seq.tokens
        ids = torch.from_numpy(table)  # on the host: the decoder uploads it without waiting for the device
        keep_all = any(toplogprobs.all_logits(s) for s in admitted)
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
                toplogprobs.keep_prompt(seq, logits[i, :lengths[i]])
            logits = logits[torch.arange(len(admitted), device=self.device),
                            torch.tensor(lengths, device=self.device) - 1]
        self._active.extend(admitted)
        plain = all(sampling.plain_greedy(s, end_banned=True) for s in admitted)  # the picks left banned ends out
        self._advance(logits, admitted, self.graphs.greedy(len(admitted)) if plain else None)

    def _decode_graphs(self) -> None:
        """One decoding step of every running row through the CUDA-graph decoder, read back at once."""
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

    def _overlappable(self) -> bool:
        """Whether this step may be launched before the host reads the last one: every row ``_overlaps``. With a
        step in flight, each row's token there is not counted yet: this step picks the one after it, which
        min_length's ban of the end_id may no longer reach."""
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
                and seq.request.top_logprobs is None and not seq.request.streaming
                and (self.lora is None or seq.request.lora is None))

    def _decode_ahead(self) -> None:
        """Launch this step, then read and report the one launched before it (if any) while the device runs it.

        The step's tokens are the last step's picks, gathered on the device (``GraphDecoder.step_after``); a row
        the last step ends (its max_new_tokens reached, or cancelled) is padding in it. A row the last step ends
        by its end_id or a stop word is found only when that step is read: this step's token for it is dropped.
        """
        prev, rows, padding = self._ahead, list(self._active), set()
        host, events = self._buffers[self._turn]
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
        self._ahead = _Ahead(rows, padding, picks, host, events)
        if prev is not None:
            self._report(prev)

    def _settle(self) -> None:
        """Read and report the step in flight, if any (before a step that reads its own tokens back)."""
        if self._ahead is not None:
            prev, self._ahead = self._ahead, None
            self._report(prev)

    def _report(self, launched: _Ahead) -> None:
        """Wait for a launched step (without the GIL) and report its tokens."""
        if launched.events:
            self._wait(launched.events)
        picks = launched.host.numpy()[:len(launched.rows)].tolist()
        live = [(i, seq) for i, seq in enumerate(launched.rows) if not seq.finished and i not in launched.padding]
        if live:
            self._advance(None, [seq for _, seq in live],
                          ([int(picks[i][0]) for i, _ in live], [picks[i][1] for i, _ in live]))

    def _wait(self, events: tuple) -> None:
        """Wait (without the GIL) for the decoding step between ``events`` = (launched, done); count the wait and
        the device's time in the step."""
        waited = time.perf_counter_ns()
        events[1].synchronize()
        self.wait_ns += time.perf_counter_ns() - waited
        self.device_ns += int(events[0].elapsed_time(events[1]) * 1e6)
