"""How the ranks of a tensor-parallel python-target model meet and talk (see distributed.py for what they do).

Rank and world size come from the launcher's environment (Open MPI, PMI, Slurm); the rendezvous address from
``MASTER_ADDR``/``MASTER_PORT``, which forge sets. The ranks form one gloo group for rank 0's commands (a
:class:`Command` before each forward pass or cache change, which the followers repeat) and sum their
row-parallel outputs over the compute group: gloo on CPU, NCCL on GPU, or symmetric memory (allreduce.py).
The commands of every step and admission travel as an int64 header and table, the rest pickled.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from . import allreduce


# (rank variable, size variable) of each launcher, in the order they are trusted.
RANK_VARIABLES = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMIX_RANK", "SLURM_NTASKS"),
                  ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
# Ranks that have not all arrived after this long give up (one line naming the address they waited on).
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
CLOSE_TIMEOUT_S = 10.0  # the longest a rank waits for its process groups' teardown (Group.close)
# Idle servers wait on the next broadcast for as long as nobody asks anything.
IDLE_TIMEOUT = datetime.timedelta(days=365)


class DistributedError(RuntimeError):
    """The ranks cannot form (or lost) their group; one line for the log."""


def world_from_env(env: dict[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) as the launcher (mpirun, srun) set them; (0, 1) when none did."""
    env = os.environ if env is None else env
    for rank_var, size_var in RANK_VARIABLES:
        if env.get(rank_var, "").isdigit() and env.get(size_var, "").isdigit():
            return int(env[rank_var]), int(env[size_var])
    return 0, 1


def local_rank(env: dict[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    for name in LOCAL_RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


#: the CUDA-graph decoder's commands sent as plain tensors, one header and one int64 table each: a step of tokens,
#: one launched before the last was read (its tokens are the last step's picks of the rows given, on the device),
#: the slots kept after rows finish and a plain prefill (the commands of every step and admission)
PACKED = {"gstep": 2, "gafter": 3, "gkeep": 4, "gprefill": 5}
KINDS = {kind: op for op, kind in PACKED.items()}
HEADER = 3  # kind, rows, columns; kind 0: pickled, 1: "decode"
MESSAGE = 1024  # int64s of one broadcast: a count, then each command's header and table (a bigger table apart)
#: a prefill travels packed when these are all its settings (the engine's plain admissions)
PLAIN_PREFILL = {"lengths", "needs", "banned", "all_logits", "modules", "prompts"}



@dataclass
class Group:
    """This process's place in the tensor-parallel group and the channel rank 0 commands through."""

    rank: int
    size: int
    control: Any = None  # the group of the commands (gloo, waits as long as the server idles)
    compute: Any = None  # the group of the all-reduces (the same on CPUs; NCCL on GPUs)
    pickled: int = 0  # rank 0: commands sent pickled (none per step or admission: tests count them)
    broadcasts: int = 0  # rank 0: broadcasts the commands took
    deferred: list = field(default_factory=list)  # rank 0: packed commands that ride with the next one
    received: deque = field(default_factory=deque)  # a follower: commands that came with an earlier one
    summed: Any = None  # a faster sum of the compute group (allreduce.SymmetricSum), where one was set up
    summing: str = "gloo"  # how the sums are taken, in words (use_all_reduce)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj``; every rank returns it."""
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def send(self, cmd: "Command", defer: bool = False) -> None:
        """Rank 0: one command to every follower. The commands of every step and admission (a decoding step,
        the CUDA-graph decoder's steps, slot moves and plain prefills) travel as an int64 header and table,
        several in one broadcast of MESSAGE int64s where they fit (a bigger table follows in its own); the
        rest pickled, which takes about twice as long as two broadcasts. ``defer``: the command waits for the
        next one and rides in its broadcast (a slot move, which nothing reads before the next step)."""
        packed = _pack(cmd)
        if defer and packed[0][0] != 0 and _size(self.deferred + [packed]) <= MESSAGE:
            self.deferred.append(packed)
            return
        if _size(self.deferred + [packed]) > MESSAGE and self.deferred:
            self._broadcast(self.deferred)
            self.deferred = []
        self._broadcast(self.deferred + [packed])
        self.deferred = []
        if packed[0][0] == 0:
            self.pickled += 1
            self.broadcast(cmd)

    def _broadcast(self, commands: list[tuple[list[int], torch.Tensor | None]]) -> None:
        """One message of packed commands; the last one's table apart when it does not fit."""
        import torch.distributed as dist

        message = torch.zeros(MESSAGE, dtype=torch.long)
        message[0] = len(commands)
        at, apart = 1, None
        for header, table in commands:
            message[at:at + HEADER] = torch.tensor(header)
            at += HEADER
            size = 0 if table is None else table.numel()
            if at + size > MESSAGE:
                apart = table
            elif size:
                message[at:at + size] = table.reshape(-1)
                at += size
        dist.broadcast(message, 0, group=self.control)
        self.broadcasts += 1
        if apart is not None:
            dist.broadcast(apart, 0, group=self.control)
            self.broadcasts += 1

    def receive(self) -> "Command":
        """A follower: the next command of rank 0 (see ``send``)."""
        import torch.distributed as dist

        if self.received:
            return self.received.popleft()
        message = torch.zeros(MESSAGE, dtype=torch.long)
        dist.broadcast(message, 0, group=self.control)
        at = 1
        for _ in range(int(message[0])):
            kind, rows, width = (int(x) for x in message[at:at + HEADER])
            at += HEADER
            if kind == 0:
                self.received.append(self.broadcast())
                continue
            if at + rows * width <= MESSAGE:
                table = message[at:at + rows * width].view(rows, width)
                at += rows * width
            else:
                table = torch.zeros((rows, width), dtype=torch.long)
                dist.broadcast(table, 0, group=self.control)
            self.received.append(_unpack(kind, table))
        return self.received.popleft()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks (every rank calls this, in the same order); in place, or a new
        tensor where the symmetric-memory sum took it."""
        if self.summed is not None and self.summed.takes(tensor):
            return self.summed(tensor)
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.compute)
        return tensor

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Tear the process groups down, waiting at most ``timeout`` s; whether that ended. On two H200s
        rank 0's ``destroy_process_group`` never returned after a tp 2 run with compiled layers (the follower
        had exited): a stop must not wait for it, and the process's exit releases what it holds."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return True

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone: nothing left to tear down cleanly
                pass

        thread = threading.Thread(target=destroy, name="forge-tp-close", daemon=True)
        thread.start()
        thread.join(timeout)
        return not thread.is_alive()


def leave_now() -> None:
    """End this process at once, exit status 0, after a process-group teardown that did not finish
    (``Group.close`` returned False). The interpreter's own teardown would destroy the group's threads while
    one is still inside the stuck teardown: std::terminate, an abort (both ranks, two H200s, tp 2 with
    compiled layers)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def join(expected: int) -> Group:
    """Join the launcher's world of ``expected`` ranks over gloo (within JOIN_TIMEOUT)."""
    import torch.distributed as dist

    rank, size = world_from_env()
    if size != expected:
        raise DistributedError(
            f"this model is tensor parallel over {expected} ranks but was started in a world of {size}; "
            f"start it with forge serve (or mpirun/srun -n {expected})")
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        raise DistributedError("MASTER_ADDR and MASTER_PORT are not set: rank 0's address is unknown; "
                               "start the ranks with forge serve or forge deploy's scripts")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=size,
                                timeout=JOIN_TIMEOUT)
        commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DistributedError(f"rank {rank} of {size} could not meet the others at {address}:{port}: {first}") from exc
    return Group(rank, size, control=commands, compute=commands)


def use_device(group: Group, device: torch.device) -> None:
    """All-reduce on ``device``: NCCL for GPUs (every rank calls this, in the same order), else gloo."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
        group.compute = dist.new_group(backend="nccl")


#: how the ranks sum their row-parallel outputs on GPUs: NCCL, or through symmetric memory (allreduce.py)
ALL_REDUCES = ("nccl",) + allreduce.KINDS
AUTO_ALL_REDUCE = "nccl"  # what ``auto`` takes on GPUs
SYMMETRIC_ROWS = 512  # rows of [rows, hidden] the symmetric buffer holds: a decoding step's; bigger sums take NCCL


def use_all_reduce(group: Group, kind: str, device: torch.device, dtype: torch.dtype, hidden: int) -> str:
    """Sum the decoding steps' row-parallel outputs the ``kind`` way (``nccl`` or one of ALL_REDUCES) on a GPU;
    what is in use, in words. Every rank calls this, in the same order, with the same ``kind``."""
    if kind not in ALL_REDUCES + ("auto",):
        raise DistributedError(f"all-reduce {kind!r}: expected auto or one of {', '.join(ALL_REDUCES)}")
    if device.type != "cuda":
        return "gloo"
    kind = AUTO_ALL_REDUCE if kind == "auto" else kind
    group.summed = None
    if kind != "nccl":
        group.summed = allreduce.SymmetricSum(kind, group.compute, device, dtype, SYMMETRIC_ROWS * hidden)
    return "NCCL" if kind == "nccl" else f"symmetric memory ({kind}), NCCL above {SYMMETRIC_ROWS} rows"


# -- the commands ------------------------------------------------------------------------------------
@dataclass
class Command:
    """What every follower repeats: a forward pass or a change of the running batch's cache."""

    op: str  # "settings", "prefill", "decode", "abort", "select", "reset", "stop"; the CUDA-graph decoder's:
    #          "graphs" (build it), "gprefill", "gstep", "gafter" (a step launched before the last was read),
    #          "gkeep", "greset"
    ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    keep_all: bool = False
    merge: bool = False  # prefill: join the running batch (else replace it)
    rows: list[int] = field(default_factory=list)  # select: the rows that stay
    settings: dict[str, Any] = field(default_factory=dict)


def _pack(cmd: Command) -> tuple[list[int], torch.Tensor | None]:
    """``cmd`` as (header, table) for ``Group.send``; kind 0 with no table: it travels pickled."""
    if cmd.op == "decode":
        rows, width = cmd.mask.shape
        return [1, rows, width + 2], torch.cat([cmd.ids, cmd.positions, cmd.mask], dim=1).to(torch.long)
    if cmd.op in ("gstep", "gafter"):
        return [PACKED[cmd.op], cmd.ids.shape[0], 2], torch.cat([cmd.ids, cmd.positions], dim=1).to(torch.long)
    if cmd.op == "gkeep":
        return [PACKED[cmd.op], len(cmd.rows), 1], torch.tensor(cmd.rows, dtype=torch.long)[:, None] if cmd.rows else None
    s = cmd.settings
    if cmd.op == "gprefill" and cmd.embeds is None and set(s) <= PLAIN_PREFILL and not s.get("all_logits") \
            and not s.get("modules") and s.get("prompts") is None and s.get("needs") is not None \
            and s.get("banned") is not None:
        columns = [torch.tensor(s[key], dtype=torch.long)[:, None] for key in ("lengths", "needs", "banned")]
        return [PACKED[cmd.op], cmd.ids.shape[0], cmd.ids.shape[1] + 3], torch.cat([cmd.ids.to(torch.long), *columns],
                                                                                 dim=1)
    return [0, 0, 0], None


def _size(commands: list[tuple[list[int], torch.Tensor | None]]) -> int:
    """The int64s of one message carrying ``commands`` (tables included)."""
    return 1 + sum(HEADER + (0 if table is None else table.numel()) for _header, table in commands)


def _unpack(kind: int, table: torch.Tensor) -> Command:
    """The command ``_pack`` made of ``kind`` and ``table``."""
    op = "decode" if kind == 1 else KINDS[kind]
    if op == "decode":
        return Command(op, ids=table[:, :1], positions=table[:, 1:2], mask=table[:, 2:])
    if op == "gkeep":
        return Command(op, rows=table[:, 0].tolist())
    if op == "gprefill":
        width = table.shape[1] - 3
        lengths, needs, banned = (table[:, width + i].tolist() for i in range(3))
        return Command(op, ids=table[:, :width].contiguous(), settings={"lengths": lengths, "needs": needs,
                                                                         "banned": banned})
    return Command(op, ids=table[:, :1], positions=table[:, 1:2])
