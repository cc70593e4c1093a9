"""A torch_dist checkpoint save strategy that starts no processes.

Replaces, for dhelix's saves, megatron-core's default `TorchDistSaveShardedStrategy.save`
(megatron-core 0.19.2, dist_checkpointing/strategies/torch.py, synchronous "mcore" path).
Why: its writer (`FileSystemWriterAsync.prepare_write_data`) takes its results queue from
`filesystem_async.get_write_results_queue()`, which on first use spawns a multiprocessing
Manager (a server process kept for the rest of the run) and a resource_tracker. When a rank
is killed (kill -9, OOM), those children are orphaned under init and live on holding memory
and the log open (measured with megatron-core 0.16.1, which also forked a writer per file:
after kill -9 of one rank during a save its Manager, 266 MB, was alive half a minute later).

Here megatron-core's module-level results queue is an in-process `queue.Queue` before the first save
(megatron-core 0.19.2 writes every file on threads of the calling process,
`write_preloaded_data_multithread`, so the queue only ever crosses threads), so what lands
on disk is what megatron-core writes, and nothing outlives the rank. Also: optimizer state
goes to files of its own (`separation_hint`), so a damaged optimizer file leaves the weights
loadable with `--no-load-optim`.
"""

from __future__ import annotations

import queue

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

# Keys of optimizer state in dhelix's sharded state dict (dhelix.checkpointing): saved to
# files of their own, named `optimizer.__<rank>_<n>.distcp`.
OPTIMIZER_KEY_PREFIX = "optimizer."


def use_in_process_results_queue() -> None:
    """Give megatron-core's module-level results queue an in-process queue, unless one
    exists already, so `get_write_results_queue` never starts a Manager process. For
    synchronous saves only (an `--async-save` worker process could not reach it). Used by
    `InProcessTorchDistSaveStrategy` and by the plugin's hook around Megatron-LM's
    `save_checkpoint` (`megatron_patches.checkpoint_guard`)."""
    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError(
            "megatron-core changed dist_checkpointing.strategies.filesystem_async "
            "(no _results_queue); update megatron_patches/checkpoint_writer.py"
        )
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    # megatron-core 0.19 logs "MCore's async save is deprecated ... use NVRx" on the first
    # "mcore" save of a process, also for a synchronous save (there is no other synchronous
    # path); it does not apply to one, so mark it as said.
    torch_strategy._logged_mcore_async_deprecation = True


class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's synchronous torch_dist save with an in-process results queue (no
    Manager, no resource_tracker: its files are written by threads of the calling process)
    and optimizer state in files of its own. Same on-disk format: loads with megatron-core's
    default load strategy."""

    def __init__(self, thread_count: int = 2):
        super().__init__("torch_dist", 1, thread_count=max(2, thread_count),
                         separation_hint=OPTIMIZER_KEY_PREFIX)

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "mcore"):
        use_in_process_results_queue()
        return super().async_save(sharded_state_dict, checkpoint_dir,
                                  async_strategy=async_strategy)
