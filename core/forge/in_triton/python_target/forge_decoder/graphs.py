"""Decoding steps replayed as CUDA graphs over a static KV cache.

The engine's plain decoding step is the Hugging Face forward: on a GPU it is bound by Python and
kernel launches (H100, SmolLM2-135M shape: ~1200 launches and 21–27 ms a step at 1 to 64 rows, the
GPU busy 12 % of it). Here the step is the same arithmetic written over buffers that never move —
per layer one key and one value cache of ``[rows, kv heads, columns, head dim]``, every running
sequence in a slot, its new token written at its own position — so it is captured once per (row
bucket, column bucket) and replayed with one launch. ``GraphDecoder`` holds the slots, the buckets, the
captures and their replays; each architecture's layers are in architectures.py.

* Prefill (``prefill``) is the same arithmetic over the admitted prompts at once, right-padded to the
  longest: the fused GEMMs over every prompt token, one causal attention call per layer
  (``scaled_dot_product_attention``: flash attention on a GPU), keys and values written straight
  into the new rows' slots at their positions. Columns past a prompt's end hold padding that no
  row attends to (a row at position p attends to columns [0, p]) until its own tokens overwrite them.
  It is captured too, per (prompt bucket, width bucket) up to PREFILL_GRAPH_TOKENS padded tokens:
  prompts past the ones admitted in a bucket write into a spare slot after the last row.
* Slots follow the engine's row order: ``keep`` packs the rows that stay to the front.
* Rows past the running ones in a bucket, and the warm-up before a capture, write into one spare
  column at the end of every slot, which no row ever attends to.

A step (or prefill) with a LoRA adapter in the batch runs eagerly through the projection modules, whose
hooks add the adapters; steps without one replay the graphs. On a tensor-parallel rank (``reduce``) the row-parallel
projections are summed by an all-reduce inside the step; prompt tables only touch prefill. The step's attention
is decode_kernel's fused kernel where it runs on a GPU, cpu_kernels' on a CPU (``ATTENTION``), else SDPA.
"""

from __future__ import annotations

import torch

from . import cpu_kernels, sampling, step_attention
from .kvlayout import PagedBlocks, Staging, StaticSlots, upload


#: torch.compile's backend for ``use_compile`` (tests on CPUs set "eager": the same tracing, no code generation)
COMPILE_BACKEND = "inductor"
#: the decoding step's attention (step_attention.FORMS): "auto" takes the fused kernel on a GPU, the C one on a CPU,
#: where they run, else SDPA
ATTENTION = "auto"
ROW_BUCKETS, FIRST_COLUMNS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256), 128  # captured steps' shapes
FIRST_PREFILL_COLUMNS = 16  # prefill widths are captured in buckets 16, 32, 64, ...
PREFILL_GRAPH_TOKENS = 8192  # larger prefills (prompts × width bucket) run eagerly: launches no longer matter
EAGER_COLUMNS = 16  # uncaptured steps (a CPU) run their own rows and the columns they reach, rounded up to this
BLOCK_TOKENS = 64  # tokens per block of a paged KV cache (a power of two dividing FIRST_COLUMNS)
MODES = ("auto", "true", "false")  # -o cuda_graphs, -o torch_compile


def mode(value: str | None) -> str:
    """The ``-o cuda_graphs`` value of a model's config (empty: auto); anything else is an error."""
    return mode_of("cuda_graphs", value)


def mode_of(option: str, value: str | None) -> str:
    """An auto/true/false ``-o option`` value of a model's config (empty: auto); anything else is an error."""
    chosen = (value or "auto").lower()
    if chosen not in MODES:
        raise ValueError(f"-o {option}={value!r}: expected auto, true or false")
    return chosen


class GraphDecoder:
    """The decoding step of up to ``rows`` sequences of up to ``max_len`` tokens, as CUDA graphs.

    Subclasses (architectures.py) say where a model keeps its parts (``_layout``), prepare their tables
    (``_prepare``), write the step (``_forward``) and the prefill (``_prefill``), and may compile their layers'
    pieces (``_uncompilable``, ``_compiled``). With ``capture=False`` (or on a CPU) the step runs eagerly: what the
    tests check against transformers on a machine without a GPU.
    """

    def __init__(self, model, rows: int, max_len: int, *, capture: bool = True, paged: dict | None = None):
        self._layout(model)
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.rows, self.max_len = rows, max_len
        self.spare = max_len  # the column no row attends to
        self.spare_slot = rows  # the slot no row uses: padded prompts of a captured prefill write there
        shape = (len(self.layers), rows, self.kv_heads, self.head_dim, max_len, self.dtype, self.device)
        self.cache = PagedBlocks(*shape, **paged) if paged else StaticSlots(*shape)
        self.keys, self.values = self.cache.keys, self.cache.values
        self.columns = torch.arange(max_len + 1, device=self.device)
        with torch.no_grad():
            self._prepare(model)
        self.inputs = torch.zeros((2, rows), dtype=torch.long, device=self.device)  # ids, positions
        # the steps' inputs go through two pinned buffers in turn: where steps overlap, the one written has been
        # uploaded two launches ago, whoever launches the steps (rank 0 or a follower)
        self.staging = [Staging((2, rows), self.device) for _ in range(2)]
        self.staging_turn = 0
        self.capture = capture and self.device.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        # (prompts, width) bucket → (graph, inputs [prompts, width + 3] (prefill_views), logits, picks), and the
        # Staging its inputs are uploaded from
        self.prefill_graphs: dict[tuple[int, int], tuple] = {}
        self.prefill_staging: dict[tuple[int, int], Staging] = {}
        self.prefill_capture = self.capture  # off after a capture that failed (then prefill runs eagerly)
        self.log = print
        self.fused = None  # the layers' pieces compiled (use_compile: architectures.Fused)
        self.reduce = None  # a tensor-parallel rank's all-reduce of row-parallel outputs (architectures.decoder_for)
        self.packed, self.packing = None, "off"  # the GEMMs' weights packed on a CPU, and why (or not): pack
        self.picks: torch.Tensor | None = None  # [rows, 2]: each row's argmax token and its log-probability
        self.pool = None
        self.used = 0  # slots holding running sequences
        self.filled = 0  # columns [0, filled) hold tokens of some running sequence
        self.attention, self.attention_note = self._attention(ATTENTION)

    def _attention(self, asked: str) -> tuple[str, str]:
        """(the step's attention form, why, for the log) for an ``ATTENTION`` value (step_attention.choose)."""
        form, note, self.cpu_kernel = step_attention.choose(asked, self.heads, self.kv_heads, self.head_dim,
                                                            self.dtype, self.device, self.cache)
        return form, note

    def describe(self) -> str:
        """The KV cache, the step's attention and (on a CPU) the GEMMs, for the log."""
        return f"{self.cache.describe()}; attention {self.attention_note}" + (
            f"; GEMMs {self.packing}" if self.device.type == "cpu" else "")

    def pack(self, available: int | None) -> None:
        """Pack the GEMMs' weights for oneDNN where that runs (cpu_gemm; ``available``: host memory, bytes)."""
        self.packing = f"plain ({type(self).__name__} does not pack its weights)"

    def _layout(self, model) -> None:
        raise NotImplementedError

    def _prepare(self, model) -> None:
        raise NotImplementedError

    def _forward(self, rows: int, columns: int, modules: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for slots [0, rows) attending to columns [0, columns): the logits and, per row,
        (argmax token, its log-probability) as float32. ``modules``: the projections through their
        modules (hooks apply) instead of fused weights."""
        raise NotImplementedError

    def _prefill(self, h: torch.Tensor, slots: torch.Tensor, modules: bool, start: int = 0,
                 slot: int | None = None) -> torch.Tensor:
        """The layers over prompts ``h`` [n, width, hidden] (token embeddings, right-padded), writing their
        keys and values into ``slots`` [n] at positions [start, start + width); the final hidden states. With
        ``start`` (one prompt, in ``slot``), it attends to the slot's first ``start`` positions too."""
        raise NotImplementedError

    def _written(self, layer: int, slots: torch.Tensor, start: int, slot: int | None, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a prefill's keys and values [n, kv, width, dim]; what its queries attend to: themselves, or
        after a cached prefix the slot's keys and values from position 0."""
        self.cache.write_prompt(layer, slots, start, k, v)
        return (k, v) if not start else self.cache.read_slot(layer, slot, start + k.shape[2])

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    # -- the slots ----------------------------------------------------------------------------------
    def use_compile(self, mode: str = "false", *, backend: str | None = None) -> str:
        """Run the layers' pieces compiled by ``torch.compile`` (``-o torch_compile``): fewer, fused kernels per
        step and prefill. ``auto``: on when the step is captured on a GPU (at any tp) and compiling works here (it needs
        Triton and a C compiler; a failure is logged and the pieces stay eager); ``true``: the same, wherever
        the decoder runs, or an error; ``false``: eager. Returns what was chosen, for the log."""
        chosen = mode_of("torch_compile", mode)
        backend = backend or COMPILE_BACKEND
        if chosen == "false":
            return "off (-o torch_compile=false)"
        reason = None
        if chosen == "auto" and not self.capture:
            reason = "the step is not captured on a GPU"
        reason = reason or self._uncompilable()
        if reason is None:
            try:
                self.fused = self._compiled(backend)
                self.fused.warm_up()
            except Exception as exc:  # no compiler, an unsupported op: the eager pieces are correct too
                self.fused = None
                reason = f"compiling failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if reason is not None:
            if chosen == "true":
                raise ValueError(f"-o torch_compile=true: cannot compile the decoder's layers: {reason}")
            return f"off ({reason})"
        return f"on ({backend})"

    def _uncompilable(self) -> str | None:
        """Why this decoder's layers cannot be compiled (None: ``_compiled`` makes their pieces)."""
        return f"{type(self).__name__} has no compiled pieces"

    def _compiled(self, backend: str):
        """The layers' pieces compiled by ``torch.compile`` with ``backend``, not warmed up yet."""
        raise NotImplementedError

    def keep(self, rows: list[int]) -> None:
        """Keep only the slots ``rows`` (in that order), packed to the front (the layout's ``keep``)."""
        self.cache.keep(rows, self.used, self.filled)
        self.used = len(rows)
        if not rows:
            self.filled = 0

    def reset(self) -> None:
        self.cache.reset()
        self.used = self.filled = 0

    def room(self, needs: list[int]) -> bool | None:
        """Whether sequences that may reach ``needs`` tokens can be admitted now (None: the last never can)."""
        return self.cache.room(needs)

    # -- the prefill --------------------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor, lengths: list[int], *, embeds: torch.Tensor | None = None,
                all_logits: bool = False, modules: bool = False, needs: list[int] | None = None,
                prompts: list[list[int]] | None = None, banned: list[int] | None = None) -> torch.Tensor:
        """Prompts ``ids`` [n, width] (right-padded; row i holds ``lengths[i]`` tokens) into the next free
        slots: logits of each prompt's last token [n, vocab] (``greedy`` has their argmax), or with
        ``all_logits`` every position's [n, width, vocab]. ``embeds`` [n, width, hidden] replaces the
        token embeddings (prompt tables); ``modules`` as in ``step``. Plain prefills replay a graph of their
        bucket on a GPU. ``needs``: the tokens each sequence may reach (a paged cache's blocks; default
        max_len). ``prompts``: the prompts' tokens where their keys and values may be shared (a paged cache
        with reuse; never with embeds, adapters or all_logits): a row whose prompt starts with cached full
        blocks prefills only the rest. ``ids`` on the host: a captured prefill uploads them without waiting for
        the device. ``banned``: per prompt a token its pick may not be (-1: none; its end_id while min_length
        forbids it): the picks are the argmax and log-probability of the logits without it, the logits stay as
        they are."""
        n, width = ids.shape
        first, before = self.used, self.picks
        if first + n > self.rows:
            raise RuntimeError(f"{first + n} rows do not fit the {self.rows} slots")
        if width >= self.max_len:
            raise RuntimeError(f"a prompt of {width} tokens does not fit {self.max_len} columns")
        try:
            logits = self._prefill_slots(ids, lengths, first, embeds, all_logits, modules, needs, prompts,
                                         banned or [-1] * n)
        except BaseException:  # the slots' blocks go back; the engine fails these sequences
            self.cache.keep(list(range(first)), first + n, self.filled)
            self.picks = before
            raise
        self.used += n
        self.filled = max(self.filled, width)
        return logits

    def _prefill_slots(self, ids: torch.Tensor, lengths: list[int], first: int, embeds: torch.Tensor | None,
                       all_logits: bool, modules: bool, needs: list[int] | None,
                       prompts: list[list[int]] | None, banned: list[int]) -> torch.Tensor:
        n = ids.shape[0]
        starts = []
        for i, length in enumerate(lengths):
            starts.append(self.cache.admit(first + i, needs[i] if needs else self.max_len,
                                           prompts[i] if prompts else None))
            self.cache.grow(first + i, length - 1)
        self.cache.sync()
        fresh = [i for i, start in enumerate(starts) if not start]
        if len(fresh) == n:
            logits = self._prefill_rows(ids, lengths, list(range(first, first + n)), banned, embeds, all_logits,
                                        modules)
        else:  # prompts after a reused prefix one by one (eagerly), the others together
            parts = []
            if fresh:
                longest = max(lengths[i] for i in fresh)
                parts.append((self._prefill_rows(ids[fresh, :longest], [lengths[i] for i in fresh],
                                                 [first + i for i in fresh], [banned[i] for i in fresh]), self.picks))
            for i, start in enumerate(starts):
                if start:
                    parts.append(self._prefill_after(ids[i:i + 1, start:lengths[i]], first + i, start, banned[i]))
            order = torch.tensor(fresh + [i for i, start in enumerate(starts) if start], device=self.device)
            back = torch.empty_like(order)
            back[order] = torch.arange(n, device=self.device)
            logits = torch.cat([part[0] for part in parts])[back]
            self.picks = torch.cat([part[1] for part in parts])[back]
        for i, prompt in enumerate(prompts or []):
            self.cache.published(first + i, prompt)
        return logits

    def _prefill_rows(self, ids: torch.Tensor, lengths: list[int], slots: list[int], banned: list[int],
                      embeds: torch.Tensor | None = None, all_logits: bool = False,
                      modules: bool = False) -> torch.Tensor:
        """Prompts from position 0 into ``slots``: a captured bucket's replay, or eagerly."""
        bucket = self._prefill_bucket(*ids.shape)
        if bucket is not None and embeds is None and not all_logits and not modules:
            return self._replay_prefill(bucket, ids, slots, lengths, banned)
        last = upload(torch.tensor([length - 1 for length in lengths]), self.device)
        logits, self.picks = self._prefill_logits(upload(ids, self.device), upload(torch.tensor(slots), self.device),
                                                  last, upload(torch.tensor(banned), self.device), embeds,
                                                  all_logits, modules)
        return logits

    def _prefill_after(self, ids: torch.Tensor, slot: int, start: int,
                       banned: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt's tokens [1, w] from position ``start`` (the slot holds the ones before): the last
        token's logits and picks."""
        h = self._prefill(self.embed(upload(ids, self.device)), upload(torch.tensor([slot]), self.device), False,
                          start=start, slot=slot)
        return self._picks(self.head(self._final_norm(h[:, -1])), upload(torch.tensor([banned]), self.device))

    def _prefill_logits(self, ids: torch.Tensor, slots: torch.Tensor, last: torch.Tensor, banned: torch.Tensor,
                        embeds: torch.Tensor | None = None, all_logits: bool = False,
                        modules: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill's arithmetic (what a prefill graph captures): logits and picks of the last tokens."""
        h = self._prefill(self.embed(ids) if embeds is None else embeds, slots, modules)
        picked = torch.arange(ids.shape[0], device=self.device)
        if all_logits:
            logits = self.head(self._final_norm(h))
            return logits, self._picks(logits[picked, last], banned)[1]
        return self._picks(self.head(self._final_norm(h[picked, last])), banned)

    def _prefill_bucket(self, n: int, width: int) -> tuple[int, int] | None:
        """The captured (prompts, width) bucket for a prefill, or None: run it eagerly."""
        if not self.prefill_capture:
            return None
        rows = next((b for b in ROW_BUCKETS if n <= b <= self.rows), self.rows)
        columns = FIRST_PREFILL_COLUMNS
        while columns < width:
            columns *= 2
        if columns > self.max_len or rows * columns > PREFILL_GRAPH_TOKENS:
            return None
        return rows, columns

    def _replay_prefill(self, bucket: tuple[int, int], ids: torch.Tensor, slots: list[int],
                        lengths: list[int], banned: list[int]) -> torch.Tensor:
        """The bucket's graph over prompts ``ids`` (on the host) into ``slots``: the bucket's inputs are written on
        the host and uploaded in one copy that does not wait for the device (a step may be in flight)."""
        if bucket not in self.prefill_graphs:
            try:
                self._capture_prefill(*bucket)
            except Exception as exc:  # run every later prefill eagerly rather than fail requests
                self.prefill_capture = False
                self.log(f"forge decoder: prefill runs eagerly: capturing it failed ({type(exc).__name__}: {exc})")
                return self._prefill_rows(ids, lengths, slots, banned)
        graph, inputs, logits, picks = self.prefill_graphs[bucket]
        if bucket not in self.prefill_staging:
            self.prefill_staging[bucket] = Staging(tuple(inputs.shape), self.device)
        staging = self.prefill_staging[bucket]
        n, width = ids.shape
        columns = bucket[1]
        view = staging.write()  # this bucket's last upload is long done: a prefill's tokens were read since
        view[:] = 0
        view[:n, :width] = ids.cpu().numpy()
        view[:, columns] = self.spare_slot
        view[:n, columns] = slots
        view[:n, columns + 1] = [length - 1 for length in lengths]
        view[:, columns + 2] = -1
        view[:n, columns + 2] = banned
        staging.send(inputs)
        graph.replay()
        self.picks = picks[:n]
        return logits[:n]

    @staticmethod
    def prefill_views(inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A captured prefill's inputs ``[prompts, width + 3]`` as (ids, slots, last token's positions, banned
        tokens)."""
        columns = inputs.shape[1] - 3
        return inputs[:, :columns], inputs[:, columns], inputs[:, columns + 1], inputs[:, columns + 2]

    def _capture_prefill(self, rows: int, columns: int) -> None:
        inputs = torch.zeros((rows, columns + 3), dtype=torch.long, device=self.device)
        ids, slots, last, banned = self.prefill_views(inputs)
        slots.fill_(self.spare_slot)
        banned.fill_(-1)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: every prompt writes into the spare slot
            self._prefill_logits(ids, slots, last, banned)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits, picks = self._prefill_logits(ids, slots, last, banned)
        self.pool = graph.pool()
        self.prefill_graphs[(rows, columns)] = (graph, inputs, logits, picks)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    # -- the step -----------------------------------------------------------------------------------
    def step(self, tokens: list[int], positions: list[int], *, modules: bool = False) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` for each slot's next token at its position (``greedy`` has the
        argmax of each row and its log-probability). ``modules``: run eagerly through the model's own
        projection modules, so forward hooks (LoRA adapters) apply to this step."""
        n = len(tokens)
        rows, columns = self._bucket(n, positions, modules)
        self._upload_inputs(rows, tokens, positions)
        if modules or not self.capture:
            logits, self.picks = self._forward(rows, columns, modules=modules)
            return logits[:n]
        graph, logits, self.picks = self.graphs[(rows, columns)]
        graph.replay()
        return logits[:n]

    def step_after(self, picks: torch.Tensor, sources: list[int], positions: list[int]) -> None:
        """A step launched before the host has read the last one: row i's token is ``picks[sources[i], 0]`` (the
        last step's picks, still on the device) at ``positions[i]`` (``spare``: a row whose sequence ends with
        the last step, decoded as padding). ``self.picks`` is this step's."""
        n = len(sources)
        if max(sources, default=0) >= picks.shape[0]:  # a device-side index error would end every later step
            raise RuntimeError(f"step_after: a row's source {max(sources)} is past the {picks.shape[0]} picks")
        rows, columns = self._bucket(n, positions, False)
        self._upload_inputs(rows, sources, positions)
        self.inputs[0, :rows].copy_(picks[:, 0].index_select(0, self.inputs[0, :rows]))
        if not self.capture:
            _logits, self.picks = self._forward(rows, columns)
            return
        graph, _logits, self.picks = self.graphs[(rows, columns)]
        graph.replay()

    def _upload_inputs(self, rows: int, first: list[int], positions: list[int]) -> None:
        """``inputs[:, :rows]``: ``first`` (tokens, or step_after's sources) and ``positions``, the rows past them
        padding (token 0 at the spare column), through the next staging buffer."""
        n = len(first)
        staging = self.staging[self.staging_turn]
        self.staging_turn ^= 1
        view = staging.write()
        view[0, :n] = first
        view[1, :n] = positions
        view[0, n:rows] = 0
        view[1, n:rows] = self.spare
        staging.send(self.inputs[:, :rows], rows)

    def _bucket(self, n: int, positions: list[int], modules: bool) -> tuple[int, int]:
        """A step's (rows, columns): its captured bucket (captured now if new), else its own rows and columns."""
        need = max((p for p in positions if p != self.spare), default=0) + 1
        if need > self.max_len:
            raise RuntimeError(f"position {need - 1} is past the {self.max_len} columns of the cache")
        if self.capture:  # FIRST_COLUMNS doubled until the rows' positions fit
            rows = next((b for b in ROW_BUCKETS if n <= b <= self.rows), self.rows)
            columns = max(FIRST_COLUMNS, 1 << (need - 1).bit_length())
        else:
            rows, columns = n, -(-need // EAGER_COLUMNS) * EAGER_COLUMNS
        columns = min(columns, self.max_len)
        self.filled = max(self.filled, need)
        for slot, position in enumerate(positions):
            if position != self.spare:
                self.cache.grow(slot, position)
        self.cache.sync()
        if self.capture and not modules and (rows, columns) not in self.graphs:
            self._capture(rows, columns)
        return rows, columns

    def greedy(self, n: int) -> tuple[list[int], list[float]]:
        """The last step's argmax token of each of the first ``n`` rows and its log-probability."""
        if self.device.type == "cuda":  # wait for the step without the GIL: the response sender runs meanwhile
            torch.cuda.current_stream(self.device).synchronize()
        picks = self.picks[:n].tolist()
        return [int(t) for t, _ in picks], [lp for _, lp in picks]

    def _capture(self, rows: int, columns: int) -> None:
        # Warm up outside the capture (cuBLAS and the allocator set themselves up lazily); every row
        # writes into the spare column meanwhile, so running sequences keep their caches.
        self.inputs[0, :rows] = 0
        self.inputs[1, :rows] = self.spare
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(rows, columns)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits, picks = self._forward(rows, columns)
        self.pool = graph.pool()
        self.graphs[(rows, columns)] = (graph, logits, picks)

    # -- pieces of every architecture's step ---------------------------------------------------------
    def _step_inputs(self, rows: int, columns: int):
        """This step's ids, positions and where it writes and attends (step_attention.where)."""
        ids, pos = self.inputs[0, :rows], self.inputs[1, :rows]
        return ids, pos, step_attention.where(self, pos, columns)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where, columns: int) -> torch.Tensor:
        """Write this step's keys/values [b, kv, dim] into the cache, attend with q [b, heads, dim] (scaled
        already) over the first ``columns`` columns (``where``: _step_inputs'); returns [b, heads * dim]."""
        return step_attention.attend(self, layer, q, k, v, where, columns)

    def _picks(self, logits: torch.Tensor, banned: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, per row its argmax and log-probability [n, 2]); ``banned`` [n]: a token row i's pick leaves out
        (-1: none), as sampling.process bans an end_id that min_length forbids. Through cpu_kernels' C kernel where
        the step's attention is (a CPU)."""
        if self.cpu_kernel is not None and cpu_kernels.picks_from(logits):
            return logits, cpu_kernels.picks(self.cpu_kernel, logits, banned)
        scores = logits.float()
        if banned is not None:
            vocab = torch.arange(scores.shape[-1], device=scores.device)
            scores = scores.masked_fill(vocab[None, :] == banned[:, None], sampling.NEG_INF)
        top = scores.argmax(dim=-1, keepdim=True)
        logprob = torch.log_softmax(scores, dim=-1).gather(1, top)
        return logits, torch.cat([top.float(), logprob], dim=1)
