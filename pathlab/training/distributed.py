"""Process-group setup for ``torchrun``: the same training command runs on 1 process or N.

Under ``torchrun --nproc_per_node N`` the environment carries ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; we
initialise NCCL on CUDA and gloo on the CPU (which is how CI tests 2 processes). Without them everything is a
no-op and the world has one process.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= self.world_size
        return value

    def broadcast_object(self, obj):
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def resolve_device(name: str, local_rank: int = 0, what: str = "train.device") -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``; a CUDA device without CUDA is a
    ValueError naming the setting ``what``, before any work starts."""
    asked = name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what}: {asked!r} requested but CUDA is not available; use {what}=cpu")
    return device


def setup(device_name: str = "auto") -> DistContext:
    """Initialise the process group when launched by torchrun; return this process's context."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext(device=resolve_device(device_name))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device)


def teardown() -> None:
    """Destroy the process group, after freeing what still uses it.

    FSDP's module state and sharded parameters form reference cycles that outlive the training function. Left to
    the interpreter's exit they are freed after the group is gone, and gloo can then abort the process
    ("terminate called without an active exception"); so they are collected first, while the group is alive.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, ctx: DistContext, strategy: str = "ddp") -> torch.nn.Module:
    """DistributedDataParallel (default) or FSDP2 (``fully_shard`` per block, then the root) when world > 1.

    With ``"fsdp"`` the parameters become sharded DTensors, so build the optimiser after this call and save or
    load states through :func:`full_state_dicts` / :func:`load_full_state_dicts`.
    """
    if not ctx.enabled:
        return model
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)


def is_sharded(model: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def full_state_dicts(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimiser state dicts (a collective call for sharded models; CPU tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dicts(model: torch.nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
    """Load unsharded states (as saved by :func:`full_state_dicts`) into a sharded model and its optimiser."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
