"""Multi-process training on ``torch.distributed``: who this process is, the process group, and
how a global batch is split between the processes.

``torchrun --nproc_per_node N -m fastformer train ...`` (or ``python -m fastformer train --nproc N``,
which launches exactly that) runs N copies of the training job. torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) tells each copy its place; several
machines are torchrun's own ``--nnodes`` / ``--rdzv-*`` flags. The process group is gloo on CPUs
and nccl on GPUs (one GPU per local rank).

Every process builds the same global batches (the token-bucketed batches depend only on the
seed and the epoch) and takes a disjoint share of each one's sentences (:func:`shard_rows`).
Each process weights its mean loss by its share of the batch's target tokens, so the gradient
that DistributedDataParallel averages is exactly the single-process gradient of the whole batch:
the learning-rate schedule, the logged loss and the throughput all count the global batch, and a
checkpoint (written by rank 0 only) resumes with any number of processes.
"""
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (a lone process: rank 0 of 1)."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints, writes checkpoints and evaluates."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def world_from_env() -> World:
    """The world torchrun describes in the environment (rank 0 of 1 without torchrun)."""
    world = World(rank=_env_int("RANK", 0), size=_env_int("WORLD_SIZE", 1),
                  local_rank=_env_int("LOCAL_RANK", 0), local_size=_env_int("LOCAL_WORLD_SIZE", 1))
    if world.size < 1 or not 0 <= world.rank < world.size:
        raise ValueError(f"RANK={world.rank} must lie in [0, WORLD_SIZE={world.size})")
    if world.local_size < 1 or not 0 <= world.local_rank < world.local_size:
        raise ValueError(f"LOCAL_RANK={world.local_rank} must lie in [0, LOCAL_WORLD_SIZE={world.local_size})")
    return world


def init(world: World, device: torch.device) -> torch.device:
    """Join the process group (once) and return the device this rank trains on: its own GPU
    (``cuda:LOCAL_RANK``) on CUDA, the CPU otherwise. A lone process joins nothing."""
    if not world.distributed:
        return device
    import torch.distributed as dist

    if device.type == "cuda":
        if world.local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {world.local_rank} has no GPU: this machine has "
                             f"{torch.cuda.device_count()}; start at most that many processes per node")
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != world.size or dist.get_rank() != world.rank:
        raise RuntimeError(f"the process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"but the environment says rank {world.rank} of {world.size}")
    return device


def shutdown(world: World) -> None:
    """Wait for every rank, then leave the process group (a no-op for a lone process)."""
    import torch.distributed as dist

    if world.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard_rows(batch_size: int, world: World) -> Tuple[List[int], bool]:
    """The rows of a global batch this rank trains on: every ``size``-th sentence from its rank.

    Returns ``(rows, counts)``. A rank left without a sentence (a batch smaller than the world)
    still takes row 0 with ``counts=False``: it runs forward and backward with weight 0, so every
    rank joins DistributedDataParallel's gradient all-reduce and none contributes twice.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    rows = list(range(world.rank, batch_size, world.size))
    return (rows, True) if rows else ([0], False)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The torch seed rank ``rank`` reseeds with before step ``step`` of a multi-process run, so
    that ranks draw different dropout masks, and the same ones in every run and after a resume
    with the same number of processes."""
    mixed = (seed * 1_000_003 + step) * 8_191 + rank
    return mixed % (2**63 - 1)


def launch(nproc: int, train_argv: Sequence[str]) -> int:
    """``python -m torch.distributed.run --standalone --nproc_per_node nproc -m fastformer train
    <train_argv>``: the ``--nproc`` shortcut. Returns torchrun's exit status."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "fastformer", "train", *train_argv]
    return subprocess.call(cmd)
