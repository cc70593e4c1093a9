"""The layer a profiling job measures: megatron-core's own TransformerLayer as
`megatron.training.pretrain` builds it for the job's Megatron arguments (the step harness,
`megatron_patches.step_harness`; so the cost keys are the ones `--dhelix` training looks
up), bound to its operator programs, with the communication lanes training uses (tensor-
and, for an MoE layer, expert-parallel).

Collective over the world: `pretrain()` creates Megatron's parallel state and the model on
every rank, and the lanes are created on every rank. `profiler.cli` builds the run with one
layer per pipeline stage (`--num-layers` does not change a layer's operators or cost keys).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def build_layer_under_test(run, job, emulated=None):
    """(LayerUnderTest, Timer) for this rank from `run` (a
    `megatron_patches.step_harness.PretrainedRun`, active: Megatron's globals are its own):
    the first TransformerLayer of this rank's first model chunk. `job` is the
    `dhelix.parallel.Job` of the default process group (its timeout goes to the lanes).
    The layer's inputs are drawn on the host from `--seed` (the same on every rank) and
    moved to the layer's device in its parameter dtype; the tensors belong to the returned
    LayerUnderTest. `emulated` (an `EmulatedCalls` of `run.model`, `dhelix profile
    --gpu-emulation`): every pass runs under it and the timer drains its stream at the end
    of every region (`profiler.timing`)."""
    from dhelix.devices import model_device
    from dhelix.ops.runner import BoundLayer
    from dhelix.runtime.lanes import check_cuda_device_max_connections, layer_lanes
    from megatron_patches.gpt_parts import unwrap_gpt
    from profiler.timing import LayerUnderTest, Timer

    check_cuda_device_max_connections()
    args = run.args
    gpt = unwrap_gpt(run.model[0])
    rope = args.position_embedding_type == "rope"
    layer = gpt.decoder.layers[0]
    bound = BoundLayer(layer, args.seq_length, args.micro_batch_size, rope=rope)
    lanes = layer_lanes([bound], args.tensor_model_parallel_size, job)
    tp = args.tensor_model_parallel_size
    tokens = args.seq_length // tp if args.sequence_parallel else args.seq_length
    device, dtype = model_device(layer), layer.config.params_dtype
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (tokens, args.micro_batch_size, args.hidden_size)
    # drawn on the host (the same inputs on every device), then moved to the layer's device
    x = torch.randn(shape, generator=generator, device="cpu").to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=generator, device="cpu").to(device=device, dtype=dtype)
    rotary = gpt.rotary_pos_emb(args.seq_length) if rope else None
    if isinstance(rotary, torch.Tensor):
        rotary = rotary.detach()
    sync_group = None
    if dist.is_initialized() and dist.get_backend() != "gloo":
        sync_group = dist.new_group(backend="gloo")  # barriers and MAX on the host
    timer = (Timer(sync_group) if emulated is None
             else Timer(sync_group, cuda=False, synchronize=emulated.synchronize))
    return LayerUnderTest(bound, lanes, x, dy, rotary, emulated), timer
