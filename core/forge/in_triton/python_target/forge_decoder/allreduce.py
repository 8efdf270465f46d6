"""The ranks' sums of a tensor-parallel decoding step on GPUs of one host, through symmetric memory.

A decoding step sums two row-parallel outputs per layer over the ranks ([rows, hidden], a few hundred KB).
NCCL takes about 10-20 µs for each inside a CUDA graph on two H200s; at that size the time is the ranks'
handshake, not the bytes. PyTorch's symmetric memory (``torch.distributed._symmetric_memory``) maps every
rank's buffer into every other rank's address space (over NVLink), with signal pads for device-side barriers:

* ``one-shot`` / ``two-shot``: PyTorch's own kernels (float32 and bfloat16 only: float16 is staged as float32);
* ``peer-sum``: a copy into the buffer, PyTorch's device barrier, one add of every rank's buffer, a barrier;
* ``fused``: one Triton kernel does all of that: each program copies its part of the tensor into this rank's
  buffer, signals the same program on every other rank and waits for theirs, sums its part of every rank's
  buffer in float32 (rank 0 first: every rank adds in the same order, so every rank holds the same sum), writes
  the result, and signals again, so that no rank overwrites its buffer while another still reads it.

``benchmarks/allreduce_tp.py`` times each way against NCCL; ``ranks.use_all_reduce`` picks one.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the fused sum is not available (MISSING says why)
    triton = tl = None

MISSING = None if triton is not None else "Triton is not installed"
BLOCK = 2048  # elements a program sums per turn
MAX_PROGRAMS = 64  # programs of one fused sum (each turns over the tensor in strides): signal slots per rank


def _signal(pad, slot):
    """Set ``slot`` of another rank's signal pad, once the last signal there was taken (release, system scope)."""
    while tl.atomic_cas(pad + slot, 0, 1, sem="release", scope="sys") != 0:
        pass


def _wait(pad, slot):
    """Take the signal in ``slot`` of this rank's pad, waiting for it (acquire, system scope)."""
    while tl.atomic_cas(pad + slot, 1, 0, sem="acquire", scope="sys") != 1:
        pass


def _barrier(signals, program, RANK: tl.constexpr, WORLD: tl.constexpr):
    """This program and the same program of every other rank meet (one signal slot per program and rank)."""
    tl.debug_barrier()  # every thread's stores of this program come before the signal
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _signal(tl.load(signals + peer).to(tl.pointer_type(tl.int32)), program * WORLD + RANK)
    mine = tl.load(signals + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _wait(mine, program * WORLD + peer)
    tl.debug_barrier()  # every thread reads after the wait


def _fused_sum(x_ptr, out_ptr, buffers, signals, n, RANK: tl.constexpr, WORLD: tl.constexpr,
               BLOCK: tl.constexpr):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    mine = tl.load(buffers + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty))
    for start in range(program * BLOCK, n, programs * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < n
        tl.store(mine + offsets, tl.load(x_ptr + offsets, mask=inside), mask=inside)
    _barrier(signals, program, RANK, WORLD)
    for start in range(program * BLOCK, n, programs * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < n
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):
            theirs = tl.load(buffers + peer).to(tl.pointer_type(x_ptr.dtype.element_ty))
            total += tl.load(theirs + offsets, mask=inside, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
    _barrier(signals, program, RANK, WORLD)


if triton is not None:
    _signal, _wait, _barrier = triton.jit(_signal), triton.jit(_wait), triton.jit(_barrier)
    _fused_kernel = triton.jit(_fused_sum)


KINDS = ("one-shot", "two-shot", "peer-sum", "fused")


class SymmetricSum:
    """A sum over the ranks of ``compute`` (a process group) through symmetric memory, ``kind`` one of KINDS, for
    tensors of ``dtype`` up to ``numel`` elements (``takes``); every rank builds one, in the same order."""

    def __init__(self, kind: str, compute, device: torch.device, dtype: torch.dtype, numel: int):
        import torch.distributed._symmetric_memory as symm

        if kind == "fused" and MISSING:
            raise RuntimeError(f"the fused sum needs Triton: {MISSING}")
        self.kind, self.dtype = kind, dtype
        self.name = compute.group_name
        # torch's kernels sum float32 and bfloat16: float16 travels as float32 (two halves sum exactly there)
        wire = torch.float32 if kind in ("one-shot", "two-shot") and dtype == torch.float16 else dtype
        self.buffer = symm.empty(numel, dtype=wire, device=device)
        self.handle = symm.rendezvous(self.buffer, self.name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        self.peers = [self.handle.get_buffer(r, (numel,), wire) for r in range(self.world)] \
            if kind == "peer-sum" else []
        if kind == "fused":
            slots = int(getattr(self.handle, "signal_pad_size", 0) or 0) // 4
            self.programs = max(1, min(MAX_PROGRAMS, slots // self.world if slots else MAX_PROGRAMS))
            self.buffers = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
            self.signals = torch.tensor(self.handle.signal_pad_ptrs, dtype=torch.int64, device=device)

    def takes(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == self.dtype and tensor.is_cuda and tensor.is_contiguous() \
            and 0 < tensor.numel() <= self.buffer.numel() and (tensor.numel() * self.buffer.element_size()) % 16 == 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        n = tensor.numel()
        if self.kind == "fused":
            out = torch.empty_like(tensor)
            programs = min(self.programs, triton.cdiv(n, BLOCK))
            _fused_kernel[(programs,)](tensor, out, self.buffers, self.signals, n, RANK=self.rank, WORLD=self.world,
                                       BLOCK=BLOCK, num_warps=4)
            return out
        staged = self.buffer[:n]
        staged.copy_(tensor.view(-1))
        if self.kind == "one-shot":
            return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.name).view(tensor.shape).to(self.dtype)
        if self.kind == "two-shot":
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.name)
            return tensor.copy_(staged.view(tensor.shape))
        self.handle.barrier(channel=0)  # every rank's part is in its buffer
        out = self.peers[0][:n] + self.peers[1][:n]
        for peer in self.peers[2:]:
            out += peer[:n]
        self.handle.barrier(channel=0)  # nobody overwrites a buffer another rank still reads
        return out.view(tensor.shape)
