"""The layer a profiling job measures: megatron-core's own TransformerLayer, built from the
same Megatron arguments as training (so the cost keys are the ones training looks up),
bound to its operator programs, with the communication lanes training uses.

Collective over the world: Megatron's parallel state, the model and the lanes are created
on every rank. Only one layer per pipeline stage is built (`--num-layers` does not change a
layer's operators or cost keys).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from dhelix.devices import compute_device


def build_layer_under_test(args: argparse.Namespace, job):
    """(LayerUnderTest, Timer) for this rank; needs the default process group, whose
    `dhelix.parallel.Job` is `job` (its timeout goes to Megatron's groups and the lanes)."""
    from dhelix.ops.runner import BoundLayer
    from dhelix.parallel import ParallelSizes, init_megatron_parallel_state
    from dhelix.runtime.lanes import check_cuda_device_max_connections, comm_channels, \
        tensor_parallel_lanes
    from megatron_patches.gpt_parts import unwrap_gpt
    from megatron_patches.model_provider import build_model_chunks
    from profiler.timing import LayerUnderTest, Timer

    check_cuda_device_max_connections()
    pp = args.pipeline_model_parallel_size
    init_megatron_parallel_state(ParallelSizes(args.tensor_model_parallel_size, pp), args.seed,
                                 job)
    one_layer = argparse.Namespace(**vars(args))
    one_layer.num_layers = pp
    config, chunks = build_model_chunks(one_layer)
    gpt = unwrap_gpt(chunks[0])
    rope = args.position_embedding_type == "rope"
    layer = gpt.decoder.layers[0]
    bound = BoundLayer(layer, args.seq_length, args.micro_batch_size, rope=rope)
    lanes = tensor_parallel_lanes(args.tensor_model_parallel_size, job,
                                  channels=comm_channels([bound]))
    tp = args.tensor_model_parallel_size
    tokens = args.seq_length // tp if args.sequence_parallel else args.seq_length
    device = compute_device()
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (tokens, args.micro_batch_size, args.hidden_size)
    # drawn on the host (the same inputs on every device), then moved to the layer's device
    x = torch.randn(shape, generator=generator, device="cpu").to(device=device,
                                                                 dtype=config.params_dtype)
    dy = torch.randn(shape, generator=generator, device="cpu").to(device=device,
                                                                  dtype=config.params_dtype)
    rotary = gpt.rotary_pos_emb(args.seq_length) if rope else None
    if isinstance(rotary, torch.Tensor):
        rotary = rotary.detach()
    sync_group = None
    if dist.is_initialized() and dist.get_backend() != "gloo":
        sync_group = dist.new_group(backend="gloo")  # barriers and MAX on the host
    return LayerUnderTest(bound, lanes, x, dy, rotary), Timer(sync_group)
