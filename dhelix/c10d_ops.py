"""What torch's c10d operators (the dispatched collectives: `c10d.allreduce_`, ...) hand
back, for code that watches them under a dispatch mode (`dhelix.bench.link_floor`,
`dhelix.gpu_emulation.mode`)."""

from __future__ import annotations

import torch


def work_handles(result) -> list:
    """The Work handles in a c10d operator's result (e.g. (tensors, work)), in order."""
    found = []
    for item in (result if isinstance(result, (list, tuple)) else (result,)):
        if isinstance(item, (list, tuple)):
            found += work_handles(item)
        elif hasattr(item, "wait") and not isinstance(item, torch.Tensor):
            found.append(item)
    return found


def unboxed_work(work):
    """The Python `Work` of a dispatched collective's result (a TorchScript object there)."""
    from torch._C._distributed_c10d import Work

    return work if isinstance(work, Work) else Work.unbox(work)


def process_group_of(args):
    """The ProcessGroup a dispatched c10d operator runs on (the first of its arguments that
    is one, boxed as a TorchScript object there), or None."""
    from torch.distributed import ProcessGroup

    for item in args:
        if isinstance(item, torch.ScriptObject) and \
                item._type().qualified_name().endswith(".ProcessGroup"):
            return ProcessGroup.unbox(item)
    return None
