"""torch_dist checkpoint saves that start no processes.

megatron-core's `TorchDistSaveShardedStrategy.save` (megatron-core 0.19.2,
dist_checkpointing/strategies/torch.py, synchronous "mcore" path): its writer
(`FileSystemWriterAsync.prepare_write_data`) takes its results queue from
`filesystem_async.get_write_results_queue()`, which on first use spawns a multiprocessing
Manager (a server process kept for the rest of the run) and a resource_tracker. When a rank
is killed (kill -9, OOM), those children are orphaned under init and live on holding memory
and the log open (measured with megatron-core 0.16.1, which also forked a writer per file:
after kill -9 of one rank during a save its Manager, 266 MB, was alive half a minute later).

Here megatron-core's module-level results queue is an in-process `queue.Queue` before the first save
(megatron-core 0.19.2 writes every file on threads of the calling process,
`write_preloaded_data_multithread`, so the queue only ever crosses threads), so what lands
on disk is what megatron-core writes, and nothing outlives the rank.
"""

from __future__ import annotations

import queue

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

# Prefix of optimizer-state keys in a sharded state dict: files holding only such keys are
# optimizer-only (`dhelix.checkpoint_integrity`: `--no-load-optim` can skip a damaged one).
OPTIMIZER_KEY_PREFIX = "optimizer."


def use_in_process_results_queue() -> None:
    """Give megatron-core's module-level results queue an in-process queue, unless one
    exists already, so `get_write_results_queue` never starts a Manager process. For
    synchronous saves only (an `--async-save` worker process could not reach it). Used by
    the plugin's hook around Megatron-LM's `save_checkpoint`
    (`megatron_patches.checkpoint_guard`)."""
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
