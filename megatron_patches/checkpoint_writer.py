"""A torch_dist checkpoint save strategy that starts no processes.

Replaces, for dhelix's saves, megatron-core's default `TorchDistSaveShardedStrategy` write
path (megatron-core 0.16.1, dist_checkpointing/strategies/filesystem_async.py). Why: even a
synchronous save there forks one writer process per file (`write_preloaded_data_multiproc`,
a copy of the rank: 290-630 MB), and the first save spawns a multiprocessing Manager (a
server process kept for the rest of the run) and a resource_tracker. When a rank is killed
(kill -9, OOM), those children are orphaned under init and live on holding memory and the
log open. Measured before this change: after kill -9 of one rank of a 2-rank run during a
save, its Manager (266 MB) and resource_tracker were still alive half a minute later.

Here every file is written by a thread of the calling process, with megatron-core's own
per-file writer (`FileSystemWriterAsync.write_preloaded_data`), so what lands on disk is
what megatron-core writes, and nothing outlives the rank. The results queue megatron-core
would create through a Manager is replaced by an in-process queue (it only ever crosses
threads here). Also: optimizer state goes to files of its own (`separation_hint`), so a
damaged optimizer file leaves the weights loadable with `--no-load-optim`.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

# Keys of optimizer state in dhelix's sharded state dict (dhelix.checkpointing): saved to
# files of their own, named `optimizer.__<rank>_<n>.distcp`.
OPTIMIZER_KEY_PREFIX = "optimizer."


def _use_in_process_results_queue() -> None:
    """Give megatron-core's module-level results queue an in-process queue, unless one
    exists already, so `_get_write_results_queue` never starts a Manager process."""
    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError(
            "megatron-core changed dist_checkpointing.strategies.filesystem_async "
            "(no _results_queue); update megatron_patches/checkpoint_writer.py"
        )
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _write_in_threads(transform_list: list, use_msc: bool, rank: int, write_buckets: list,
                      results_queue) -> None:
    """Write each bucket (one file) on its own thread of this process; put the per-file
    write results, or the first exception, on `results_queue` as megatron-core's
    multi-process writer does."""
    del rank  # the signature is megatron-core's async_fn(rank, buckets, queue)

    def write_one(index_and_bucket):
        index, bucket = index_and_bucket
        local_results, count = queue.Queue(), queue.Queue()
        count.put(index)
        kwargs = {"use_msc": use_msc} if use_msc else {}
        FileSystemWriterAsync.write_preloaded_data(
            transform_list, index, bucket, local_results, count, True, **kwargs)
        return local_results.get_nowait()

    outcome: dict | Exception = {}
    with ThreadPoolExecutor(max_workers=max(1, len(write_buckets))) as pool:
        for index, result in pool.map(write_one, enumerate(write_buckets)):
            if isinstance(result, Exception):
                outcome = result
                break
            outcome[index] = result
    results_queue.put(outcome)


class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist save with every file written by threads of the calling
    process (no fork, no Manager, no resource_tracker) and optimizer state in files of its
    own. Same on-disk format: loads with megatron-core's default load strategy."""

    def __init__(self, thread_count: int = 2):
        super().__init__("torch_dist", 1, thread_count=max(2, thread_count),
                         separation_hint=OPTIMIZER_KEY_PREFIX)

    def async_save(self, sharded_state_dict, checkpoint_dir):
        _use_in_process_results_queue()
        return super().async_save(sharded_state_dict, checkpoint_dir)

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
        request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
        if request.async_fn is None:  # nothing to write on this rank
            return request
        transform_list = [writer.transforms] if hasattr(writer, "transforms") else []

        def write(rank, write_buckets, results_queue):
            _write_in_threads(transform_list, writer.use_msc, rank, write_buckets,
                              results_queue)

        return request._replace(async_fn=write)
