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

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["release_ddp", "shutdown_distributed"]

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
