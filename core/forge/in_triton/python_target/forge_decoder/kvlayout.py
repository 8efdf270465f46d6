"""Where the CUDA-graph decoder keeps keys and values: one static slot per row, or blocks from a pool.

Both layouts hold every layer's keys and values and answer the same questions, so the decoder's step and
prefill are written once over them (graphs.py, architectures.py) and captured the same way:

* ``step_index(pos)``: each (row, key/value head)'s flat row in the layer's cache for this step's token at
  its position ([rows, kv heads]) — computed on the device from tensors whose addresses never change, so a
  captured graph replays it for any positions (and, paged, any block table);
* ``write_step`` / ``read``: the step writes there, then attends over the first ``columns`` columns of
  each row;
* ``write_prompt`` / ``read_slot``: a prefill writes its prompts' keys and values at positions
  ``[start, start + width)`` of their slots; a prefill after a reused prefix reads the slot back.

``StaticSlots``: ``[rows + 1, kv heads, max_len + 1, head dim]`` per layer (views of one tensor), allocated at
load: simple and fastest to read, but it sizes every row for ``max_len`` (on a CPU in memory the kernel commits
as it is first written: ``zeros``). ``PagedBlocks``: blocks of ``block``
tokens (``[blocks + 1, kv heads, block, head dim]`` per layer) handed to a sequence as it grows, a block table
per row; a sequence is admitted when the blocks it may need (prompt + its max_tokens) are free, so a pool
sized by memory, not by rows × max_len, serves any model that fits. With ``reuse`` (``enable_kv_cache_reuse``)
full blocks of prompts stay indexed by their tokens (a hash chain, as TensorRT-LLM's block reuse): a prompt
that starts with them shares those blocks and prefills only the rest. The last block (static: the last slot;
paged: the last block) is a spare that padding rows and warm-ups write into and no row attends to.
"""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict

import torch

#: on a CPU, caches at least this large go into anonymous memory (``zeros``)
LAZY_BYTES = 1 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros``; on a CPU, a large one in anonymous memory, which the kernel hands out zeroed page by page
    as it is first written: a cache sized for every row at max_len holds in RAM what its rows wrote (the pages
    attention reads before that map the kernel's zero page), up to the bound. ``torch.zeros`` writes every page."""
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or size < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=count).view(shape)  # holds the mapping


def _write(cache: torch.Tensor, at: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` [b, kv, dim] (any strides) into the layer's cache, seen as flat rows of ``dim``, at rows ``at``
    [b, kv]: one kernel."""
    cache.view(-1, values.shape[-1]).index_put_((at,), values)


def upload(data: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device: a plain copy to a GPU first waits for
    everything queued before it (the decoding step in flight, where steps overlap)."""
    if torch.device(device).type != "cuda" or data.device.type != "cpu":
        return data.to(device)
    return data.pin_memory().to(device, non_blocking=True)


class Staging:
    """A pinned host buffer that uploads go through again and again: written only once its last upload is done (an
    event on a GPU), so the host never changes what a copy still reads, and nothing waits for the device otherwise."""

    def __init__(self, shape: tuple[int, ...], device) -> None:
        gpu = torch.device(device).type == "cuda"
        self.host = torch.zeros(shape, dtype=torch.long, pin_memory=gpu)
        self.uploaded = torch.cuda.Event() if gpu else None

    def write(self):
        """The buffer as numpy, to fill in place (plain numpy writes: no torch call gives the GIL away mid-launch),
        once its last upload is done."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
        return self.host.numpy()

    def send(self, target: torch.Tensor, width: int | None = None) -> None:
        """Copy the buffer (its first ``width`` columns) into ``target`` without waiting for the device."""
        target.copy_(self.host if width is None else self.host[:, :width], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()


class StaticSlots:
    """One slot of ``max_len + 1`` columns per row (the last column and the last slot are spares)."""

    paged = False

    def __init__(self, layers: int, rows: int, kv: int, dim: int, max_len: int, dtype, device):
        self.rows, self.kv, self.dim, self.max_len = rows, kv, dim, max_len
        self.device = device
        # every layer's keys, then values, in one tensor: moving slots (keep) is one gather and one scatter
        self.store = zeros((2 * layers, rows + 1, kv, max_len + 1, dim), dtype, device)
        self.keys = [self.store[i] for i in range(layers)]
        self.values = [self.store[layers + i] for i in range(layers)]
        self.heads_offset = (torch.arange(rows, device=device)[:, None] * kv
                             + torch.arange(kv, device=device)[None, :]) * (max_len + 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @staticmethod
    def bytes_for(layers: int, rows: int, kv: int, dim: int, max_len: int, element: int) -> int:
        return 2 * layers * (rows + 1) * kv * (max_len + 1) * dim * element

    # -- on the device (captured) -----------------------------------------------------------------
    def step_index(self, pos: torch.Tensor) -> torch.Tensor:
        return self.heads_offset[:pos.shape[0]] + pos[:, None]

    def write_step(self, layer: int, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [b, kv, dim] at the flat rows ``at`` [b, kv] (``step_index``); strided ones as they
        are (the step's keys and values are slices of wider tensors: no copy to make them contiguous)."""
        _write(self.keys[layer], at, k)
        _write(self.values[layer], at, v)

    def read(self, layer: int, b: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [0, b)'s keys and values over columns [0, columns): [b, kv, columns, dim] each."""
        return self.keys[layer][:b, :, :columns], self.values[layer][:b, :, :columns]

    def write_prompt(self, layer: int, slots: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prompts' keys and values [n, kv, width, dim] into ``slots`` [n] at positions [start, start + width)."""
        width = k.shape[2]
        self.keys[layer][:, :, start:start + width].index_copy_(0, slots, k)
        self.values[layer][:, :, start:start + width].index_copy_(0, slots, v)

    def read_slot(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's keys and values over positions [0, length): [1, kv, length, dim] each."""
        return self.keys[layer][slot:slot + 1, :, :length], self.values[layer][slot:slot + 1, :, :length]

    # -- on the host: which slot holds what --------------------------------------------------------
    def admit(self, slot: int, need: int, prompt: list[int] | None = None) -> int:
        """Slot ``slot`` takes a sequence that may reach ``need`` tokens; returns how many leading prompt
        tokens it already holds (always 0: static slots share nothing)."""
        return 0

    def grow(self, slot: int, position: int) -> None:
        """Slot ``slot`` is about to write ``position``."""

    def published(self, slot: int, prompt: list[int]) -> None:
        """The prompt's keys and values of ``slot`` are written (what reuse indexes)."""

    def sync(self) -> None:
        """Before a step or prefill runs on the device: what the host changed is in place."""

    def keep(self, rows: list[int], used: int, filled: int) -> None:
        """Keep only the slots ``rows`` (in that order), packed to the front. Only the slots that move are
        copied, and only their columns in use (at 64 rows × 8192 columns a whole copy would move gigabytes),
        every layer at once; the host does not wait for the device (a step may be in flight)."""
        moves = [(slot, row) for slot, row in enumerate(rows) if row != slot]
        if moves:
            index = upload(torch.tensor(moves, dtype=torch.long).T.contiguous(), self.device)
            columns = self.store[:, :, :, :filled]
            columns.index_copy_(1, index[0], columns.index_select(1, index[1]))

    def reset(self) -> None:
        pass

    def room(self, needs: list[int]) -> bool | None:
        """Whether sequences that may reach ``needs`` tokens fit beside the running ones now (None: the last
        one never will, whatever finishes)."""
        return True

    def describe(self) -> str:
        return f"static KV cache of {self.nbytes / 2**20:.0f} MiB"


class PagedBlocks:
    """Blocks of ``block`` tokens from a pool of ``blocks`` (+ the spare), a block table per row."""

    paged = True

    def __init__(self, layers: int, rows: int, kv: int, dim: int, max_len: int, dtype, device, *,
                 block: int, blocks: int, reuse: bool = False):
        if block < 1 or block & (block - 1):
            raise ValueError(f"a KV-cache block holds a power of two of tokens, not {block}")
        self.rows, self.kv, self.dim, self.max_len, self.block = rows, kv, dim, max_len, block
        self.device, self.blocks, self.reuse = device, blocks, reuse
        self.spare = blocks
        shape = (blocks + 1, kv, block, dim)
        self.keys = [zeros(shape, dtype, device) for _ in range(layers)]
        self.values = [zeros(shape, dtype, device) for _ in range(layers)]
        self.width = max_len // block + 1  # blocks a row's table holds: columns [0, max_len] (the spare column too)
        self.table = torch.full((rows + 1, self.width), blocks, dtype=torch.long, device=device)
        self.host = torch.full((rows + 1, self.width), blocks, dtype=torch.long,
                               pin_memory=torch.device(device).type == "cuda")
        self.dirty = False
        self.heads = torch.arange(kv, device=device)
        self.slot_blocks: list[list[int]] = [[] for _ in range(rows + 1)]
        self.promised = [0] * (rows + 1)  # blocks each slot may come to hold (admission keeps their sum ≤ blocks)
        self.free = list(range(blocks - 1, -1, -1))
        self.refs = [0] * blocks
        # reuse: a full prompt block's key (hash of its tokens and of the blocks before it) → block; blocks no
        # slot holds stay indexed (least recently used first) until a new block needs their memory
        self.index: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @staticmethod
    def block_bytes(layers: int, kv: int, dim: int, block: int, element: int) -> int:
        return 2 * layers * kv * block * dim * element

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(min(tokens, self.max_len) / self.block)

    # -- on the device (captured) -----------------------------------------------------------------
    def _flat(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Flat rows of the pool for (block, offset) pairs of any shape S: [*S, kv] → with heads last."""
        return (blocks.unsqueeze(-1) * self.kv + self.heads) * self.block + offsets.unsqueeze(-1)

    def step_index(self, pos: torch.Tensor) -> torch.Tensor:
        blocks = self.table[:pos.shape[0]].gather(1, (pos // self.block)[:, None]).squeeze(1)
        return self._flat(blocks, pos % self.block)

    def write_step(self, layer: int, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _write(self.keys[layer], at, k)
        _write(self.values[layer], at, v)

    def _gather(self, pool: torch.Tensor, table: torch.Tensor, columns: int) -> torch.Tensor:
        """[n, blocks] of block ids → [n, kv, columns, dim]: the rows' blocks laid side by side."""
        n, count = table.shape
        out = pool[table].permute(0, 2, 1, 3, 4).reshape(n, self.kv, count * self.block, self.dim)
        return out[:, :, :columns]

    def read(self, layer: int, b: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.table[:b, :math.ceil(columns / self.block)]
        return self._gather(self.keys[layer], table, columns), self._gather(self.values[layer], table, columns)

    def write_prompt(self, layer: int, slots: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        width = k.shape[2]
        pos = torch.arange(start, start + width, device=k.device)
        blocks = self.table[slots][:, pos // self.block]  # [n, width]; past a slot's blocks: the spare
        at = self._flat(blocks, (pos % self.block).expand_as(blocks))  # [n, width, kv]
        at = at.transpose(1, 2).reshape(-1)  # as k's [n, kv, width] order
        self.keys[layer].view(-1, self.dim).index_copy_(0, at, k.reshape(-1, self.dim))
        self.values[layer].view(-1, self.dim).index_copy_(0, at, v.reshape(-1, self.dim))

    def read_slot(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.table[slot:slot + 1, :math.ceil(length / self.block)]
        return self._gather(self.keys[layer], table, length), self._gather(self.values[layer], table, length)

    # -- on the host: blocks ---------------------------------------------------------------------
    def room(self, needs: list[int]) -> bool | None:
        if self.blocks_for(needs[-1]) > self.blocks:
            return None
        return sum(self.promised) + sum(self.blocks_for(n) for n in needs) <= self.blocks

    def admit(self, slot: int, need: int, prompt: list[int] | None = None) -> int:
        self.promised[slot] = self.blocks_for(need)
        self.slot_blocks[slot] = []
        if not (self.reuse and prompt):
            return 0
        # full blocks of the prompt, leaving at least one token to prefill (its logits start the output)
        shared = []
        for key in self._chain(prompt, (len(prompt) - 1) // self.block):
            block = self.index.get(key)
            if block is None:
                break
            shared.append(block)
        for block in shared:
            self._hold(block)
        self.slot_blocks[slot] = shared
        self._write_table(slot)
        return len(shared) * self.block

    def _chain(self, prompt: list[int], count: int) -> list[tuple]:
        """The keys of the prompt's first ``count`` blocks: (hash of the key before, the block's own tokens)
        — its tokens compared exactly, the prefix before it by a 64-bit hash chain."""
        keys, parent = [], 0
        for i in range(count):
            key = (parent, tuple(prompt[i * self.block:(i + 1) * self.block]))
            keys.append(key)
            parent = hash(key)
        return keys

    def _hold(self, block: int) -> None:
        if self.refs[block] == 0:
            self.idle.pop(block, None)
        self.refs[block] += 1

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.idle[block] = None  # its tokens stay findable until the memory is needed
            else:
                self.free.append(block)

    def _take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:  # admission promised it: an indexed block nobody holds gives way (least recently used)
            block, _ = self.idle.popitem(last=False)
            del self.index[self.key_of.pop(block)]
        self.refs[block] = 1
        return block

    def grow(self, slot: int, position: int) -> None:
        blocks = self.slot_blocks[slot]
        while len(blocks) <= position // self.block:
            blocks.append(self._take())
            self.host[slot, len(blocks) - 1] = blocks[-1]
            self.dirty = True

    def published(self, slot: int, prompt: list[int]) -> None:
        if not self.reuse:
            return
        blocks = self.slot_blocks[slot]
        for i, key in enumerate(self._chain(prompt, len(prompt) // self.block)):
            block = blocks[i]
            if key not in self.index and block not in self.key_of:
                self.index[key], self.key_of[block] = block, key

    def _write_table(self, slot: int) -> None:
        blocks = self.slot_blocks[slot]
        self.host[slot].fill_(self.spare)
        if blocks:
            self.host[slot, :len(blocks)] = torch.tensor(blocks)
        self.dirty = True

    def sync(self) -> None:
        if self.dirty:
            self.table.copy_(self.host, non_blocking=True)
            self.dirty = False

    def keep(self, rows: list[int], used: int, filled: int) -> None:
        kept = set(rows)
        for slot in range(used):
            if slot not in kept:
                for block in self.slot_blocks[slot]:
                    self._release(block)
        self.slot_blocks[:len(rows)] = [self.slot_blocks[r] for r in rows]
        self.promised[:len(rows)] = [self.promised[r] for r in rows]
        for slot in range(len(rows), self.rows + 1):
            self.slot_blocks[slot], self.promised[slot] = [], 0
        self.host[:len(rows)] = self.host[rows].clone() if rows else self.host[:0]
        self.host[len(rows):].fill_(self.spare)
        self.dirty = True

    def reset(self) -> None:
        self.keep([], self.rows, 0)

    def describe(self) -> str:
        reuse = ", prefix reuse" if self.reuse else ""
        return f"paged KV cache of {self.nbytes / 2**20:.0f} MiB: {self.blocks} blocks of {self.block} tokens{reuse}"
