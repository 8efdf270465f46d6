"""Tensor-parallel decoding over ``torch.distributed``: rank 0 serves, the other ranks follow.

A repository built with ``--target python --tp N`` runs as N processes started by ``mpirun`` or
``srun`` (one rank each, the way tensorrtllm_backend orchestrates ranks): rank 0 is tritonserver,
whose python model drives the continuous-batching engine; ranks 1..N-1 run
``python -m forge_decoder.follower`` (this directory on ``PYTHONPATH``). Every rank holds its shard of
each attention and MLP block, split exactly like the TensorRT-LLM rank files forge exports: Q heads and
the MLP's first projection(s) by output rows (column parallel; key/value heads too, or one copy of a KV
head per rank when there are fewer KV heads than ranks), the attention output and the MLP's last
projection by input columns (row parallel, summed with an all-reduce). Embeddings and the LM head stay
whole on every rank, so sampling happens on rank 0 alone.

Before each forward pass rank 0 broadcasts a :class:`ranks.Command` (the step's token ids, mask, positions,
and the KV-cache bookkeeping of the batch; ``LeaderEngine``, ``Announced``), and the followers repeat it on
their own shard and cache (``Follower``); the all-reduces inside the forward pass then meet. How the ranks
meet, how the commands travel and how the sums are taken: ranks.py.
"""

from __future__ import annotations

import atexit
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from . import architectures
from . import engine as engine_mod
from . import graphs, kvcache
from .ranks import (CLOSE_TIMEOUT_S, Command, DistributedError, Group, join, leave_now, local_rank, use_all_reduce,
                    use_device)


def rank_device(name: str) -> torch.device:
    """This rank's device: ``auto`` is the GPU of its local rank where there are GPUs, else the CPU."""
    device = engine_mod.choose_device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank() % max(1, torch.cuda.device_count()))
    return device


# -- sharding ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sharding:
    """Which modules of a Hugging Face decoder are split how (module name suffixes)."""

    qkv_fused: tuple[str, ...] = ()  # Conv1D [in, q|k|v] (GPT-2's c_attn)
    q: tuple[str, ...] = ()  # Linear, split by heads
    kv: tuple[str, ...] = ()  # Linear, split by KV heads (or one copy of a head per rank)
    column: tuple[str, ...] = ()  # output features split
    row: tuple[str, ...] = ()  # input features split, then all-reduced


SHARDINGS = {
    "gpt2": Sharding(qkv_fused=("attn.c_attn",), column=("mlp.c_fc",), row=("attn.c_proj", "mlp.c_proj")),
    "llama": Sharding(q=("self_attn.q_proj",), kv=("self_attn.k_proj", "self_attn.v_proj"),
                    column=("mlp.gate_proj", "mlp.up_proj"), row=("self_attn.o_proj", "mlp.down_proj")),
}
SHARDINGS["mistral"] = SHARDINGS["llama"]


def _heads(config) -> tuple[int, int, int]:
    """(attention heads, KV heads, head size) of a Hugging Face config."""
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    return heads, kv, head_dim


def _kv_rows(kv: int, head_dim: int, tp: int, rank: int) -> slice:
    """This rank's KV rows: its share of the heads, or (fewer heads than ranks) a copy of head rank·kv/tp."""
    if kv >= tp:
        n = kv * head_dim // tp
        return slice(rank * n, (rank + 1) * n)
    start = (rank * kv // tp) * head_dim
    return slice(start, start + head_dim)


def check_shardable(config, tp: int) -> None:
    """Refuse (one line) a model this runtime cannot split over ``tp`` ranks."""
    if config.model_type not in SHARDINGS:
        raise DistributedError(f"tensor parallelism of the python target covers {', '.join(sorted(SHARDINGS))} "
                               f"models, not {config.model_type!r}")
    heads, kv, _ = _heads(config)
    if heads % tp or (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise DistributedError(f"{heads} attention heads / {kv} KV heads cannot be split over {tp} ranks")


def shard(model, tp: int, rank: int, group: Group) -> None:
    """Keep this rank's slice of every split module of ``model`` (in place) and hook the all-reduces."""
    config = model.config
    check_shardable(config, tp)
    split = SHARDINGS[config.model_type]
    heads, kv, head_dim = _heads(config)
    q_rows = slice(rank * heads * head_dim // tp, (rank + 1) * heads * head_dim // tp)
    kv_rows = _kv_rows(kv, head_dim, tp, rank)
    local_heads, local_kv = heads // tp, max(1, kv // tp)

    def keep(module, rows: slice | list, *, conv1d: bool) -> None:
        # nn.Linear holds [out, in], transformers' Conv1D [in, out]: output features are dim 0 or 1.
        out_dim = 1 if conv1d else 0
        index = torch.arange(module.weight.shape[out_dim])[rows] if isinstance(rows, slice) else torch.tensor(rows)
        module.weight = torch.nn.Parameter(module.weight.index_select(out_dim, index).contiguous(), False)
        if getattr(module, "bias", None) is not None:
            module.bias = torch.nn.Parameter(module.bias.index_select(0, index).contiguous(), False)
        _set_features(module, out=len(index), conv1d=conv1d)

    def split_inputs(module, *, conv1d: bool) -> None:
        in_dim = 0 if conv1d else 1
        n = module.weight.shape[in_dim] // tp
        module.weight = torch.nn.Parameter(
            module.weight.narrow(in_dim, rank * n, n).contiguous(), False)
        if getattr(module, "bias", None) is not None and rank:
            # The bias is added once: by rank 0, before the sum.
            module.bias = torch.nn.Parameter(torch.zeros_like(module.bias), False)
        _set_features(module, inp=n, conv1d=conv1d)
        module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))

    for name, module in model.named_modules():
        conv1d = type(module).__name__ == "Conv1D"
        if name.endswith(split.qkv_fused):
            q_dim, kv_dim = heads * head_dim, kv * head_dim
            rows = (list(range(q_dim))[q_rows] + list(range(q_dim, q_dim + kv_dim))[kv_rows]
                    + list(range(q_dim + kv_dim, q_dim + 2 * kv_dim))[kv_rows])
            keep(module, rows, conv1d=conv1d)
        elif name.endswith(split.q):
            keep(module, q_rows, conv1d=conv1d)
        elif name.endswith(split.kv):
            keep(module, kv_rows, conv1d=conv1d)
        elif name.endswith(split.column):
            n = (module.weight.shape[1 if conv1d else 0]) // tp
            keep(module, slice(rank * n, (rank + 1) * n), conv1d=conv1d)
        elif name.endswith(split.row):
            split_inputs(module, conv1d=conv1d)
        # Attention modules that remember their head counts see their local share.
        if hasattr(module, "split_size") and hasattr(module, "c_attn"):  # GPT-2: q|k|v widths of c_attn
            module.split_size = local_heads * head_dim
            if hasattr(module, "num_heads"):
                module.num_heads = local_heads
            if hasattr(module, "embed_dim"):
                module.embed_dim = local_heads * head_dim
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = local_heads // local_kv


def _set_features(module, *, out: int | None = None, inp: int | None = None, conv1d: bool) -> None:
    if conv1d:
        if out is not None and hasattr(module, "nf"):
            module.nf = out
        if inp is not None and hasattr(module, "nx"):
            module.nx = inp
        return
    if out is not None:
        module.out_features = out
    if inp is not None:
        module.in_features = inp


def load_shard(weights, device: torch.device, dtype: torch.dtype, group: Group, all_reduce: str = "auto"):
    """The Hugging Face model with this rank's shard of each split module (loaded whole, then cut); its sums
    taken the ``all_reduce`` way (``use_all_reduce``)."""
    model = engine_mod.load_model(weights, torch.device("cpu"), dtype)
    use_device(group, device)
    shard(model, group.size, group.rank, group)
    group.summing = use_all_reduce(group, all_reduce, device, dtype, int(model.config.hidden_size))
    return model.to(device).eval()


class LeaderEngine(engine_mod.Engine):
    """The engine of rank 0: the plain engine, announcing every forward pass and cache change first."""

    def __init__(self, model, limits, *, group: Group, **kwargs):
        super().__init__(model, limits, **kwargs)
        self.group = group
        self.reduce = group.all_reduce

    def use_graphs(self, mode: str = "auto", **kwargs) -> str:
        """The CUDA-graph decoder on every rank: rank 0 chooses (its free memory sizes the cache), the
        followers build the same one, and every call that runs the layers or moves the slots is announced."""
        chosen = super().use_graphs(mode, **kwargs)
        if self.graphs is not None:
            decoder = self.graphs
            cache = decoder.cache
            paged = {"block": cache.block, "blocks": cache.blocks, "reuse": cache.reuse} if cache.paged else None
            compiled = decoder.fused.backend if decoder.fused is not None else None
            self.group.send(Command("graphs", settings={
                "rows": decoder.rows, "max_len": decoder.max_len, "capture": decoder.capture, "paged": paged,
                "compile": compiled}))
            self.graphs = Announced(decoder, self.group)
        return chosen

    def _forward(self, ids, mask, positions, cache, keep_all=False, embeds=None, rows=None):
        decode = self._batch is not None and cache is self._batch.cache
        if decode:
            self.group.send(Command("decode", ids=ids.cpu(), mask=mask.cpu(), positions=positions.cpu()))
        else:
            self.group.send(Command(
                "prefill", ids=ids.cpu(), mask=mask.cpu(), positions=positions.cpu(), keep_all=keep_all,
                embeds=None if embeds is None else embeds.cpu(),
                merge=self._batch is not None and bool(self._active)))
        try:
            return super()._forward(ids, mask, positions, cache, keep_all=keep_all, embeds=embeds, rows=rows)
        except Exception:
            if not decode:
                self.group.send(Command("abort"))  # the followers drop the cache they just filled
            raise

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self._active) if not s.finished]
        if len(keep) != len(self._active) and self.graphs is None:  # the graph decoder announces its own keep
            self.group.send(Command("select", rows=keep) if keep else Command("reset"))
        super()._drop_finished()

    def _fail_all(self, message: str, pending: bool = False) -> None:
        if self._active and self.graphs is None:
            self.group.send(Command("reset"))
        super()._fail_all(message, pending)

    def stop(self, timeout: float = 30.0) -> bool:
        ended = super().stop(timeout)
        if not ended:  # the engine thread, still in a step, owns the group; the followers end with this process
            return False
        try:
            self.group.send(Command("stop"))
        except Exception:  # a follower already gone (the launcher is stopping every rank)
            pass
        if not self.group.close():
            self.log(f"forge decoder: the process groups' teardown did not finish within {CLOSE_TIMEOUT_S:g} s; "
                     "the process leaves without its interpreter's teardown")
            atexit.register(leave_now)
        return True


class Announced:
    """Rank 0's CUDA-graph decoder: what runs the layers (their all-reduces meet the followers') or moves the
    slots is announced to the followers first; everything else is the decoder's own."""

    def __init__(self, decoder: graphs.GraphDecoder, group: Group):
        self._decoder, self._group = decoder, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._decoder, name)

    def step(self, tokens: list[int], positions: list[int], *, modules: bool = False) -> torch.Tensor:
        self._group.send(Command("gstep", ids=torch.tensor(tokens)[:, None], positions=torch.tensor(positions)[:, None]))
        return self._decoder.step(tokens, positions, modules=modules)

    def step_after(self, picks: torch.Tensor, sources: list[int], positions: list[int]) -> None:
        """An overlapped step: every rank gathers its tokens from its own last step's picks (the ranks' picks are
        equal: the head is not split), so only the rows' sources and positions travel."""
        self._group.send(Command("gafter", ids=torch.tensor(sources)[:, None], positions=torch.tensor(positions)[:, None]))
        self._decoder.step_after(picks, sources, positions)

    def prefill(self, ids: torch.Tensor, lengths: list[int], **kwargs) -> torch.Tensor:
        first = self._decoder.used
        embeds = kwargs.get("embeds")
        self._group.send(Command("gprefill", ids=ids.cpu(), embeds=None if embeds is None else embeds.cpu(),
                                 settings={"lengths": lengths, **{k: v for k, v in kwargs.items() if k != "embeds"}}))
        try:
            return self._decoder.prefill(ids, lengths, **kwargs)
        except Exception:  # the followers' slots go back as rank 0's did
            self._group.send(Command("gkeep", rows=list(range(first))))
            raise

    def keep(self, rows: list[int]) -> None:
        self._group.send(Command("gkeep", rows=rows), defer=True)
        self._decoder.keep(rows)

    def reset(self) -> None:
        self._group.send(Command("greset"))
        self._decoder.reset()


class Follower:
    """A rank > 0: repeats rank 0's forward passes on its shard and keeps its cache in step."""

    def __init__(self, model, group: Group):
        self.model = model
        self.group = group
        self.runner = engine_mod.Engine(model, engine_mod.Limits(0, 0, 0), log=lambda _m: None)
        self.graphs: graphs.GraphDecoder | None = None  # rank 0's "graphs" command builds it
        self.last_picks: torch.Tensor | None = None  # the picks of this rank's last decoding step (gafter reads them)
        self.batch: kvcache.BatchCache | None = None
        self.pending: tuple[kvcache.BatchCache, bool] | None = None  # a prefill not yet joined to the batch
        self.steps = 0

    def _commit(self) -> None:
        if self.pending is None:
            return
        batch, merge = self.pending
        self.pending = None
        if merge and self.batch is not None:
            self.batch.merge(batch)
        else:
            self.batch = batch

    def run(self) -> None:
        """Follow until rank 0 says stop (or the group breaks)."""
        device = self.runner.device
        with torch.inference_mode():
            while True:
                cmd = self.group.receive()
                if cmd.op == "abort":
                    self.pending = None
                    continue
                self._commit()
                if cmd.op == "stop":
                    return
                if cmd.op == "reset":
                    self.batch = None
                elif cmd.op == "select":
                    self.batch.select(cmd.rows)
                elif cmd.op == "prefill":
                    cache = kvcache.new_cache()
                    mask = cmd.mask.to(device)
                    self.runner._forward(cmd.ids.to(device), mask, cmd.positions.to(device), cache,
                                         keep_all=cmd.keep_all,
                                         embeds=None if cmd.embeds is None else cmd.embeds.to(device))
                    self.pending = (kvcache.BatchCache(cache, mask), cmd.merge)
                elif cmd.op == "decode":
                    self.batch.mask = cmd.mask.to(device)
                    self.runner._forward(cmd.ids.to(device), self.batch.mask, cmd.positions.to(device),
                                         self.batch.cache)
                elif cmd.op.startswith("g") or cmd.op == "graphs":
                    self._graphs(cmd, device)
                self.steps += 1

    def _graphs(self, cmd: Command, device: torch.device) -> None:
        """Rank 0's CUDA-graph decoder commands, repeated on this rank's decoder."""
        if cmd.op == "graphs":
            s = cmd.settings
            self.graphs = architectures.decoder_for(self.model, s["rows"], s["max_len"], capture=s["capture"],
                                                    paged=s["paged"], reduce=self.group.all_reduce)
            if s.get("compile"):  # as rank 0 did; where compiling fails here the eager pieces sum the same way
                try:
                    self.graphs.use_compile("true", backend=s["compile"])
                except ValueError:
                    pass
        elif cmd.op == "gstep":
            self.graphs.step(cmd.ids[:, 0].tolist(), cmd.positions[:, 0].tolist())
            self.last_picks = self.graphs.picks
        elif cmd.op == "gafter":
            self.graphs.step_after(self.last_picks, cmd.ids[:, 0].tolist(), cmd.positions[:, 0].tolist())
            self.last_picks = self.graphs.picks
        elif cmd.op == "gprefill":
            s = dict(cmd.settings)
            try:  # a refusal (a slot or width check) happens on rank 0 too, which then sends gkeep
                self.graphs.prefill(cmd.ids, s.pop("lengths"),
                                    embeds=None if cmd.embeds is None else cmd.embeds.to(device), **s)
            except Exception:  # noqa: BLE001 - whatever rank 0 catches around the same prefill (then gkeep)
                return
        elif cmd.op == "gkeep":
            self.graphs.keep(cmd.rows)
        elif cmd.op == "greset":
            self.graphs.reset()


def watch_leader(settings: dict[str, Any]) -> None:
    """A follower exits (``os._exit``) within a fraction of a second when its launcher or, on the same
    host, rank 0's process is gone: a follower waiting on an idle group would otherwise wait a year."""
    try:
        import forge_glue  # beside forge_decoder in the model's version directory (the follower's PYTHONPATH)
    except ImportError:  # forge_decoder used on its own (tests): nothing to watch with
        return
    same_host = settings.get("host") == socket.gethostname()
    leader = [int(settings["pid"])] if same_host and settings.get("pid") else []
    forge_glue.exit_with_parent(also=leader, what="follower")


def lead(tp: int, weights, device: torch.device, dtype: torch.dtype, threads: int, all_reduce: str = "auto"):
    """Rank 0: form the group, tell the followers what to load, load this rank's shard.

    Returns the model and the engine class to run it with (the followers join its every step).
    """
    import functools

    group = join(tp)
    if device.type == "cuda" and device.index is None:
        device = rank_device(device.type)
    group.broadcast(Command("settings", settings={
        "weights": str(weights), "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "threads": threads, "pid": os.getpid(), "host": socket.gethostname(),  # pid/host: see watch_leader
        "all_reduce": all_reduce}))
    return load_shard(weights, device, dtype, group, all_reduce), functools.partial(LeaderEngine, group=group)

