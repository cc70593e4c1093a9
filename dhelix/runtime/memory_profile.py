"""Per-operator memory of a bound layer, measured once where a plan is made: what the
planner's memory bound (`planner.memory`) reads.

One forward and one backward of the layer run operator by operator in program order on a
zero input (`dhelix.memtrace.measure_steps` reads the live bytes after each operator and
the most during it). Autograd-saved tensors of the traced regions (`graph` values) are
counted as the allocator sees them, which no declared shape would give.

Side effects, none of which reach training: the layer's parameters are set not to require
grad while it runs (so no gradient reaches `param.grad` / `main_grad` and no grad-sync hook
fires; the norms' weight gradients, a few hidden-size vectors, are then not computed), and
the RNG states (torch's, and megatron-core's CUDA RNG tracker when it has states) are
restored afterwards, so dropout draws the same numbers as without the measurement. The
collectives run on the layer's own groups: every rank of the layer's groups must call this
together. The readings are reduced to their maximum over the world, or over the group
given (the ranks of one pipeline stage, which hold the same layers), so every rank plans
from the same numbers (plans must agree across ranks whose collectives pair up).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_patches.moe_regions import record_tracker_state
from planner.memory import OpMemory


def _max_over(values: list, device, group) -> list:
    """`values` (floats) reduced to their maximum over `group` (default the world)."""
    tensor = torch.tensor(values, device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in tensor.tolist()]


def boundary_spec(desc) -> tuple:
    """(shape, dtype) of a layer's input and output, and of their gradients: the
    [local sequence, micro-batch, hidden] tensor one layer hands the next (`desc`, a
    layer's `LayerDescription`)."""
    return (desc.local_seq, desc.micro_batch_size, desc.hidden_size), getattr(torch, desc.dtype)


def boundary_bytes(desc) -> int:
    """Bytes of one such boundary tensor (`boundary_spec`)."""
    (seq, batch, hidden), dtype = boundary_spec(desc)
    return seq * batch * hidden * dtype.itemsize


@contextmanager
def _no_side_effects(layer):
    params = [p for p in layer.parameters() if p.requires_grad]
    tracker = None
    try:
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker_states = tracker.get_states()
    except Exception:  # noqa: BLE001 - no megatron-core tracker initialised: nothing to keep
        tracker = None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), record_tracker_state():
        for p in params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in params:
                p.requires_grad_(True)
            if tracker is not None:
                tracker.set_states(tracker_states)


def measure_op_memory(bound, device: torch.device, rotary_pos_emb=None, group=None
                      ) -> tuple[OpMemory, OpMemory]:
    """(forward, backward) `OpMemory` of `bound` (a `dhelix.ops.runner.BoundLayer`) run on
    `device`, with `rotary_pos_emb` as the layer gets it. Collective over the layer's
    groups and `group` (default the world), whose ranks get the same readings (module
    docstring)."""
    from dhelix.memtrace import measure_steps

    desc = bound.description
    execution = bound.new_execution()
    programs = bound.programs
    fwd_ids, bwd_ids = programs.forward.ids, programs.backward.ids
    shape, dtype = boundary_spec(desc)
    x = torch.zeros(shape, dtype=dtype, device=device)
    grad = torch.zeros(shape, dtype=dtype, device=device)
    handed = {}

    def step(op_id):
        return lambda: execution.run(op_id)

    def turn():
        handed["y"] = execution.end_forward()
        execution.begin_backward(grad)

    def finish():
        handed["dx"] = execution.end_backward()

    layer = bound.layer
    with _no_side_effects(layer):
        execution.begin_forward(x, None, rotary_pos_emb)
        readings = measure_steps([step(o) for o in fwd_ids] + [turn]
                                 + [step(o) for o in bwd_ids] + [finish])
    handed.clear()
    flat = _max_over([v for pair in readings for v in pair], device, group)
    readings = list(zip(flat[0::2], flat[1::2]))
    fwd_r, bwd_r = readings[:len(fwd_ids)], readings[len(fwd_ids) + 1:-1]
    return (_op_memory(fwd_ids, fwd_r, 0.0),
            _op_memory(bwd_ids, bwd_r, readings[len(fwd_ids)][0]))


def _op_memory(ids, readings, start: float) -> OpMemory:
    """Deltas and transients from (live after, peak during) readings relative to one base;
    `start` is the live bytes before the first op."""
    delta, transient = {}, {}
    before = start
    for op_id, (live, peak) in zip(ids, readings):
        delta[op_id] = int(live - before)
        transient[op_id] = int(max(peak, live) - before)
        before = live
    return OpMemory(delta, transient)


def measure_loss_part_peak(parts, desc, device: torch.device, rotary_pos_emb=None,
                           group=None) -> float:
    """The most one micro-batch's loss part (final norm, output layer and loss,
    `GPTParts.post`) holds above what existed before it, over its forward and its backward
    from the per-token losses' sum: at Megatron's step peak (its first backward's start)
    this sits on top of the layers' saved activations. Run on a zero hidden state of the
    layer output's shape (`desc`, a layer's `LayerDescription`) and zero tokens on `device`,
    with every parameter of `parts.model` not requiring grad for the call (so no gradient
    reaches `param.grad` / `main_grad`: the output layer's weight gradient is not part of
    the reading, which errs low) and the RNG states restored. Collective over the loss
    part's groups (its vocabulary-parallel cross-entropy) and `group` (default the world),
    whose ranks get the same reading (their maximum), in bytes."""
    from dhelix.memtrace import measure_steps
    from megatron_patches.gpt_parts import PreOutput

    shape, dtype = boundary_spec(desc)
    tokens = torch.zeros(desc.micro_batch_size, desc.seq_length, device=device,
                         dtype=torch.long)
    positions = torch.arange(desc.seq_length, device=device).unsqueeze(0).expand_as(tokens)

    def forward_backward():
        hidden = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
        losses = parts.post(hidden, tokens, positions, tokens,
                            PreOutput(decoder_input=None, rotary_pos_emb=rotary_pos_emb))
        torch.autograd.backward(losses.sum())

    with _no_side_effects(parts.model):
        (_, peak), = measure_steps([forward_backward])
    return _max_over([float(peak)], device, group)[0]
