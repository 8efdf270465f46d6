"""The fused all-reduce kernel (forge_decoder/allreduce.py) on CPUs, in Triton's interpreter.

Each rank is a process of its own (spawned: the interpreter is chosen when Triton is imported); the "symmetric"
buffers and signal pads are shared memory that every rank maps and addresses on its own, so the kernel's loads
and signals between ranks are real ones between processes, only run by the interpreter instead of a GPU. On GPUs the same kernel reads the other ranks' buffers over NVLink
(benchmarks/allreduce_tp.py checks its sums there).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

RUNTIME = Path(__file__).resolve().parents[2] / "core" / "forge" / "in_triton" / "python_target"


def _rank(rank: int, world: int, sizes: list[int], dtype, inputs, outputs, staged, pads) -> None:
    sys.path.insert(0, str(RUNTIME))
    from forge_decoder import allreduce

    buffers = torch.tensor([b.data_ptr() for b in staged], dtype=torch.int64)  # this process's addresses
    signals = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)

    for turn, n in enumerate(sizes):  # one after another, as the layers of a step sum
        out = torch.empty(n, dtype=dtype)
        programs = min(allreduce.MAX_PROGRAMS, -(-n // allreduce.BLOCK))
        allreduce._fused_kernel[(programs,)](inputs[rank][turn, :n].contiguous(), out, buffers, signals, n,
                                             RANK=rank, WORLD=world, BLOCK=allreduce.BLOCK)
        outputs[rank][turn, :n] = out


# (bfloat16 is left to the GPU: Triton's interpreter truncates float32 to bfloat16 where GPUs round to nearest)
@pytest.mark.parametrize("world, dtype", [(2, torch.float16), (3, torch.float16), (4, torch.float32)])
def test_the_fused_sum_of_every_rank_is_the_float32_sum_in_rank_order_and_leaves_no_signal(world, dtype):
    """Three sums in a row (under one block, several programs, a ragged end): every rank gets the same sum, the
    float32 sum of the ranks' parts in rank order rounded to ``dtype``, and every signal was taken."""
    sys.path.insert(0, str(RUNTIME))
    from forge_decoder import allreduce

    sizes = [100, 3 * allreduce.BLOCK, 2 * allreduce.BLOCK + 40]
    width = max(sizes)
    generator = torch.Generator().manual_seed(world)
    inputs = [torch.randn(len(sizes), width, generator=generator).to(dtype) for _ in range(world)]
    outputs = [torch.zeros(len(sizes), width, dtype=dtype).share_memory_() for _ in range(world)]
    staged = [torch.zeros(width, dtype=dtype).share_memory_() for _ in range(world)]
    pads = [torch.zeros(allreduce.MAX_PROGRAMS * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_rank, args=(r, world, sizes, dtype, inputs, outputs, staged, pads))
             for r in range(world)]
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # the ranks' environment: Triton picks the interpreter on import
    try:
        for process in ranks:
            process.start()
    finally:
        os.environ.pop("TRITON_INTERPRET") if before is None else os.environ.update(TRITON_INTERPRET=before)
    for process in ranks:
        process.join(120)
    alive = [p.pid for p in ranks if p.is_alive()]
    for process in ranks:
        process.kill() if process.is_alive() else None
    assert not alive, "a rank still waits for a signal"
    assert [p.exitcode for p in ranks] == [0] * world
    for turn, n in enumerate(sizes):
        expected = inputs[0][turn, :n].float()
        for rank in range(1, world):
            expected = expected + inputs[rank][turn, :n].float()
        for rank in range(world):
            assert torch.equal(outputs[rank][turn, :n], expected.to(dtype)), (turn, rank)
    assert all(int(p.abs().sum()) == 0 for p in pads)


def test_the_ways_to_sum_are_checked_and_cpus_sum_over_gloo():
    sys.path.insert(0, str(RUNTIME))
    from forge_decoder import ranks

    group = ranks.Group(0, 2)
    assert ranks.use_all_reduce(group, "auto", torch.device("cpu"), torch.float32, 64) == "gloo"
    assert ranks.use_all_reduce(group, "fused", torch.device("cpu"), torch.float32, 64) == "gloo"
    assert group.summed is None
    with pytest.raises(ranks.DistributedError, match="all-reduce 'fastest': expected auto or one of nccl, "):
        ranks.use_all_reduce(group, "fastest", torch.device("cpu"), torch.float32, 64)
