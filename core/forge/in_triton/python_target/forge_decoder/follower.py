"""A follower rank of a tensor-parallel python-target model: ``python -m forge_decoder.follower``.

Started by mpirun/srun beside rank 0's tritonserver, with the model's ``1/`` directory on
``PYTHONPATH``. It joins rank 0's group, learns from it which weights, device and dtype to use, loads
its shard and repeats every forward pass until rank 0 says stop. Exit status: 0 after stop (also when the
process groups' teardown does not finish: the process then leaves without its interpreter's teardown), 1
when the group cannot form or breaks (the launcher then stops every rank).
"""

from __future__ import annotations

import sys

import torch

from . import distributed, ranks
from . import engine as engine_mod


def main() -> int:
    rank, size = ranks.world_from_env()
    prefix = f"forge follower rank {rank}/{size}"
    distributed.watch_leader({})  # until rank 0 is known: exit with the launcher
    try:
        if size < 2 or rank == 0:
            raise ranks.DistributedError(
                "started outside a multi-rank launch (rank 0 is tritonserver); use forge serve or forge deploy")
        group = ranks.join(size)  # rank 0 knows the model's settings: device, dtype, weights
        settings = group.broadcast().settings
        distributed.watch_leader(settings)  # exit with rank 0 or the launcher, whatever this rank is doing
        device = distributed.rank_device(settings["device"])
        torch.set_num_threads(int(settings["threads"]))
        dtype = engine_mod.DTYPES[settings["dtype"]]
        model = distributed.load_shard(settings["weights"], device, dtype, group, settings.get("all_reduce", "auto"))
        print(f"{prefix}: {type(model).__name__} shard on {device} ({settings['dtype']}), following rank 0",
              flush=True)
        follower = distributed.Follower(model, group)
        follower.run()
    except ranks.DistributedError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # the group broke (rank 0 died) or the shard failed to load
        print(f"{prefix}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr, flush=True)
        return 1
    print(f"{prefix}: stopped after {follower.steps} steps", flush=True)
    if not group.close():
        print(f"{prefix}: the process groups' teardown did not finish within {ranks.CLOSE_TIMEOUT_S:g} s",
              file=sys.stderr, flush=True)
        ranks.leave_now()
    return 0


if __name__ == "__main__":
    sys.exit(main())
