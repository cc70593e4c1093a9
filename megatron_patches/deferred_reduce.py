"""The embedding's tensor-parallel all-reduce, issued asynchronously.

Without sequence parallelism Megatron's vocab-parallel embedding all-reduces its output
(`VocabParallelEmbedding.forward` -> `reduce_from_tensor_model_parallel_region`), and the
next kernel waits for it. In an SI block the other strand could compute meanwhile. Here
Megatron's `_preprocess` runs unchanged but for that all-reduce, which returns the rank's
partial sum as it is (its backward is the identity, as `_ReduceFromModelParallelRegion`'s):
the autograd graph is stock's. The partial [b, s, h] is then copied, in that layout, into
the storage of the embedding output (which the graph does not save), all-reduced there
asynchronously on the same TP group and, once landed, transposed in place to [s, b, h]
(through a transient copy): while it travels the rank holds the output's bytes only, as
stock does. On a TP group of two ranks every element's sum is one addition, the same in
any layout, so there the partial is copied transposed, straight into [s, b, h], and
all-reduced in place: nothing is left to do once it lands (no transient copy of the
output where the other strand computes). The layer input is handed on as a
`dhelix.arriving.Finishing`: the layer execution that reads it holds it pending and its
first reader waits (`dhelix.ops.runner`), so the strand executor runs the other strand
while it travels.

Exact (the all-reduce sums the same tensor in the same layout as stock's, or on two ranks
one addition an element, and the layout change is a copy) where everything the embedding
does after its all-reduce is that layout change: `embedding_deferrable` checks it (no
sequence parallelism, position or token-type embedding, MuP scaling, fp32 residual,
embedding dropout).

(The output layer's input-gradient all-reduce in the backward stays Megatron's: hidden
under the output layer's weight-gradient GEMM, waited on before the final norm's backward.
Deferring it too was measured: it kept the final norm's saved input and the partial
gradient alive beside the next embedding, 2 [s, b, h] tensors above the blocking peak on
a TP=2 test model, and hid nothing the embedding's did not, as the SI block's backward
strand starts on it.)

The tensors live on the model's device; on GPU the wait orders the current stream after
the collective, on CPU it blocks the thread. The `Finishing` owns the output's storage.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import layers as tp_layers

from dhelix.arriving import Finishing


def embedding_deferrable(model) -> bool:
    """True if `model`'s (a GPTModel with its embedding) embedding all-reduce can be
    deferred exactly: tensor parallelism without sequence parallelism, and nothing but the
    [b, s, h] -> [s, b, h] copy after the all-reduce."""
    embedding = getattr(model, "embedding", None)
    if embedding is None or not getattr(model, "pre_process", False):
        return False
    words, config = embedding.word_embeddings, model.config
    dropout = getattr(embedding.embedding_dropout, "p", 1.0)
    return (words.tp_group.size() > 1 and not config.sequence_parallel
            and not words.reduce_scatter_embeddings
            and not getattr(embedding, "reduce_scatter_embeddings", False)
            and not embedding.add_position_embedding
            and embedding.tokentype_embeddings is None
            and not (getattr(config, "use_mup", False)
                     and getattr(config, "mup_embedding_mult", 1.0) != 1.0)
            and not config.fp32_residual_connection and dropout == 0.0)


@contextlib.contextmanager
def _partial_sums(record: list):
    """Within: Megatron's embedding keeps its partial sum (appended to `record` with its
    group) instead of all-reducing it; the identity in the graph, as the all-reduce's
    backward is."""
    original = tp_layers.reduce_from_tensor_model_parallel_region

    def keep_partial(input_, group=None):
        record.append((input_, group))
        return input_

    tp_layers.reduce_from_tensor_model_parallel_region = keep_partial
    try:
        yield
    finally:
        tp_layers.reduce_from_tensor_model_parallel_region = original


def embedding_forward(preprocess):
    """(what `preprocess()` returns, the layer input as a `Finishing`): `preprocess` runs
    Megatron's embedding (a `GPTParts.pre` call) and returns a `PreOutput` whose
    `decoder_input` carries the graph; its values are the sum only once the `Finishing`
    was waited on. Call only where `embedding_deferrable`."""
    record: list = []
    with _partial_sums(record):
        pre = preprocess()
    if len(record) != 1:
        raise RuntimeError(f"the embedding all-reduced {len(record)} times (expected once); "
                           "run with --dhelix-no-embedding-overlap")
    partial, group = record[0]
    value = pre.decoder_input.detach()
    if (partial.transpose(0, 1).shape != value.shape or partial.dtype != value.dtype
            or not value.is_contiguous()):
        raise RuntimeError(f"the embedding's partial sum {partial.dtype} "
                           f"{tuple(partial.shape)} does not transpose to its output "
                           f"{value.dtype} {tuple(value.shape)}; run with "
                           "--dhelix-no-embedding-overlap")
    if dist.get_world_size(group) == 2:
        # two ranks: every element's sum is one addition, the same in any layout, so the
        # partial moves into the output's storage transposed and nothing is left to do once
        # it lands (no transient copy beside the strand that then computes)
        with torch.no_grad():
            value.copy_(partial.transpose(0, 1))
        del partial, record[:]
        return pre, Finishing(value, dist.all_reduce(value, group=group, async_op=True),
                              _nothing_left)
    # the partial moves into the output's storage in its own [b, s, h] layout, so only the
    # output's bytes are held while the all-reduce travels (stock's layout: the same sums,
    # added in the same order on more than two ranks)
    in_flight = value.view(partial.shape)
    with torch.no_grad():
        in_flight.copy_(partial)
    del partial, record[:]
    work = dist.all_reduce(in_flight, group=group, async_op=True)

    def finish():
        with torch.no_grad():
            value.copy_(in_flight.clone().transpose(0, 1))

    return pre, Finishing(value, work, finish)


def _nothing_left() -> None:
    """`Finishing`'s finish where the all-reduce left the value in place."""
