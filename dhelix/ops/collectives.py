"""How a communication kernel talks to its process group.

`GroupCollectives` issues the real asynchronous torch.distributed collective on a group
(the layer's TP group or a lane's clone). `NoOpCollectives` is the benchmark's
communication-free bound (TIMING ONLY, WRONG NUMERICS): every collective returns at once
with an already-completed handle and an output of the right shape filled from local data
(all-gather: the local shard repeated; reduce-scatter: the local chunk unreduced;
all-reduce: the input unchanged; all-to-all: the local rows repeated), so the computation that follows runs on finite values of
the usual magnitude but the training is wrong. It is only reachable through
`Lanes(no_comm_timing_only=True)`, i.e. `--dhelix-commfree-timing-only`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class CompletedWork:
    """A work handle that is already complete (the no-op collectives' result)."""

    @staticmethod
    def wait(timeout=None) -> bool:
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


class GroupCollectives:
    """Asynchronous collectives on one process group; each returns its work handle."""

    def __init__(self, group):
        self.group = group

    def size(self) -> int:
        return self.group.size()

    def all_gather_into_tensor(self, output: torch.Tensor, shard: torch.Tensor):
        return dist.all_gather_into_tensor(output, shard, group=self.group, async_op=True)

    def reduce_scatter_tensor(self, output: torch.Tensor, full: torch.Tensor):
        return dist.reduce_scatter_tensor(output, full, group=self.group, async_op=True)

    def all_reduce(self, tensor: torch.Tensor):
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def rank(self) -> int:
        """This process's rank in the group."""
        return self.group.rank()

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor,
                          output_split_sizes: list, input_split_sizes: list):
        """Rows of `tensor` split by `input_split_sizes` sent to the group's ranks in order;
        `output` receives `output_split_sizes[r]` rows from rank r."""
        return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                      input_split_sizes=input_split_sizes, group=self.group,
                                      async_op=True)


class NoOpCollectives(GroupCollectives):
    """Timing only, wrong numerics: no communication at all (see the module docstring).
    Output shapes equal the real collectives'; the group is only asked for its size."""

    def all_gather_into_tensor(self, output: torch.Tensor, shard: torch.Tensor):
        output.view(self.size(), *shard.shape).copy_(shard.unsqueeze(0).expand(
            self.size(), *shard.shape))
        return CompletedWork()

    def reduce_scatter_tensor(self, output: torch.Tensor, full: torch.Tensor):
        output.copy_(full[:output.shape[0]])
        return CompletedWork()

    def all_reduce(self, tensor: torch.Tensor):
        return CompletedWork()

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor,
                          output_split_sizes: list, input_split_sizes: list):
        """The output rows filled cyclically from the local rows (zeros without any)."""
        if output.shape[0] and tensor.shape[0]:
            index = torch.arange(output.shape[0], device=output.device) % tensor.shape[0]
            output.copy_(tensor.index_select(0, index))
        else:
            output.zero_()
        return CompletedWork()
