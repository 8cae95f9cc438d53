"""A clean end to a distributed (DDP) run: no gloo worker thread may outlive the Python interpreter.

Why by hand: gloo's worker threads release each finished collective *after* the caller's ``wait()`` returns,
and that release drops a reference to a tensor with a Python object, which takes the GIL. If the interpreter is
already finalising at that moment the thread is unwound while taking the GIL and the process aborts
("terminate called without an active exception", SIGABRT, exit code 134). ``destroy_process_group`` only
forgets the group; its threads are joined when the last reference to it goes, and a
``DistributedDataParallel`` wrapper keeps one (its reducer, logger and ``process_group``) until the interpreter
collects it, too late. PyTorch has no public call for this (pytorch/pytorch#179291 tried an ``atexit`` hook
and was abandoned).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import ignite.distributed as idist
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ACCELERATORS", "gather_on_rank0", "rank_device", "release_ddp", "shutdown_distributed"]

ACCELERATORS = ("auto", "cuda", "cpu")


def rank_device(accelerator: str = "auto", local_rank: int | None = None) -> torch.device:
    """The device of this process in a ``torchrun`` launch: ``cuda:<local rank>`` or the CPU.

    ``auto`` takes the GPU of the local rank when CUDA is available and the CPU otherwise; ``cuda`` insists on a
    GPU; ``cpu`` runs every rank on the CPU (gloo), e.g. for tests on a machine that has a GPU. A rank without a
    GPU of its own (more processes per node than GPUs) is an error that says so, rather than a CUDA error
    about an invalid device ordinal. ``local_rank`` defaults to torchrun's ``LOCAL_RANK`` (0 if unset).
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("accelerator 'cuda' was asked for but CUDA is not available; use --accelerator cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: {count} CUDA device(s) visible on this node; launch at most "
            f"{count} process(es) per node (torchrun --nproc_per_node), or run the ranks on the CPU with "
            "--accelerator cpu"
        )
    return torch.device(f"cuda:{local_rank}")


def gather_on_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` (picklable: states of CPU tensors and plain values), as a list by rank on rank 0 and
    ``None`` on the others. A collective: every rank must call it. ``[obj]`` when not distributed.

    Why not ``idist.all_gather``: every rank would receive every rank's objects (per-rank states can hold
    network-sized vectors), where only the rank that writes needs them.
    """
    if idist.get_world_size() == 1:
        return [obj]
    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        # NCCL: through the current CUDA device, which the caller must have set (the bundles: torch.cuda.set_device)
        dist.gather_object(obj, gathered, dst=0)
        return gathered
    every = idist.all_gather(obj)  # another ignite backend (Horovod, XLA)
    return list(every) if idist.get_rank() == 0 else None


_DDP_GROUP_HOLDERS = ("reducer", "logger")


def release_ddp(*models: nn.Module) -> None:
    """Drop what ties each ``DistributedDataParallel`` wrapper to its process group (call after training).

    The wrapped module (``model.module``) stays usable, e.g. for evaluation; the wrapper itself must not run
    another forward/backward. Other modules are ignored.
    """
    for model in models:
        if not isinstance(model, DistributedDataParallel):
            continue
        for attr in _DDP_GROUP_HOLDERS:
            if hasattr(model, attr):
                delattr(model, attr)
        model.process_group = None


def shutdown_distributed(*models: nn.Module, destroy: bool = True) -> None:
    """End a distributed run so that the gloo/NCCL threads stop before the interpreter does.

    Waits for every rank (barrier), releases the DDP wrappers in ``models`` (:func:`release_ddp`), destroys the
    default process group (``destroy=False`` leaves that to a launcher such as ``ignite.distributed.Parallel``,
    which destroys it itself) and collects garbage, so the group's last reference goes and its worker threads
    are joined now. A no-op when ``torch.distributed`` is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    release_ddp(*models)
    if destroy:
        dist.destroy_process_group()
    gc.collect()
