"""The forward strand's embedding under the backward strand's loss backward (PP=1 SI blocks).

Megatron's vocab-parallel embedding ends in a synchronous collective over the TP group (an
all-reduce; a reduce-scatter with sequence parallelism). In an SI block the forward
strand's micro-batch needs its embedding before its first layer, and the backward strand's
micro-batch starts with the loss backward (loss, output layer, final norm): computation
with nothing on the link but Megatron's own asynchronous input-gradient all-reduce. Run one
after the other, the embedding's collective is exposed once per micro-batch.

`EmbeddingOverlap.start` runs Megatron's embedding code, unchanged (`GPTParts.pre`), on a
helper thread with the embedding's collective routed to a lane group (the same ranks as the
TP group); `finish` joins the thread and returns the `PreOutput`. Between the two the
caller runs the loss backward on its own thread.

Guarantees and requirements:
- the lane is idle while the embedding uses it: the caller starts no lane collective
  between `start` and `finish` (the layer runner's last block of a layer pair waits for
  its collectives, so none is left from the previous SI block), and every rank issues the
  embedding's collective on the lane in the same place of its sequence;
- the embedding module's `tp_group` points at the lane only between `start` and `finish`
  and is restored when the thread ends, also on error; the caller's thread must not run
  the embedding in that interval;
- results are Megatron's: the same code on the same inputs, the same collective over the
  same ranks, the same draws of the default RNG (the loss backward draws none);
- an exception in the helper thread is raised by `finish`; the thread never outlives it.
"""

from __future__ import annotations

import threading

import torch.distributed as dist


class _Result:
    """What the helper thread produced: its value, or the exception it raised."""

    value = None
    error: BaseException | None = None


class EmbeddingOverlap:
    """Overlaps `parts.pre` (the embedding of one micro-batch) with the caller's work.
    `lane`: a process group with the ranks of the embedding's TP group."""

    def __init__(self, parts, lane):
        self.parts = parts
        self.lane = lane
        self.word_embeddings = parts.model.embedding.word_embeddings
        own = dist.get_process_group_ranks(self.word_embeddings.tp_group)
        if dist.get_process_group_ranks(lane) != own:
            raise ValueError(f"the embedding's lane has ranks "
                             f"{dist.get_process_group_ranks(lane)}, its TP group {own}")
        self._thread: threading.Thread | None = None
        self._result: _Result | None = None

    def start(self, input_ids, position_ids) -> None:
        """Begin the embedding of one micro-batch on a helper thread."""
        if self._thread is not None:
            raise RuntimeError("EmbeddingOverlap.start while an embedding is in progress")
        result = _Result()

        def run():
            module, group = self.word_embeddings, self.word_embeddings.tp_group
            module.tp_group = self.lane
            try:
                result.value = self.parts.pre(input_ids, position_ids)
            except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
                result.error = exc
            finally:
                module.tp_group = group

        self._result = result
        self._thread = threading.Thread(target=run, name="dhelix-embedding", daemon=True)
        self._thread.start()

    def finish(self):
        """Wait for the embedding started last; returns its `PreOutput` (or raises what the
        helper thread raised)."""
        thread, result = self._thread, self._result
        if thread is None:
            raise RuntimeError("EmbeddingOverlap.finish without start")
        thread.join()
        self._thread = self._result = None
        if result.error is not None:
            raise result.error
        return result.value
