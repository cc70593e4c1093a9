"""Rank bodies for the operator-program tests (spawned by dhelix.harness; module-level so
they pickle by name). One launch per world size runs many checks, because each process
pays ~4 s of imports on a 2-core machine.

Every check compares the explicit programs with Megatron's own autograd path on the same
layer objects (same parameters) and the same inputs, on real gloo process groups.
"""

from __future__ import annotations

import itertools
import random

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.training.argument_utils import core_transformer_config_from_args

from dhelix.memtrace import measure_peak
from dhelix.ops.runner import LayerStack
from megatron_patches.parsed_arguments import parse_megatron_args
from tests.megatron_lm_ranks import TINY

SEQ, BATCH, HIDDEN, HEADS, FFN = 16, 2, 64, 8, 128

# Each knob of the layer, by name: (norm, positions, attention, mlp, bias).
NORMS = ("LayerNorm", "RMSNorm")
POSITIONS = ("learned_absolute", "rope")
ATTENTIONS = ("mha", "gqa")
MLPS = ("gelu", "swiglu")
BIASES = (True, False)
ALL_VARIANTS = list(itertools.product(NORMS, POSITIONS, ATTENTIONS, MLPS, BIASES))
# A covering subset: every value of every knob, in combinations that differ pairwise.
COVERING_VARIANTS = [
    ("LayerNorm", "learned_absolute", "mha", "gelu", True),     # GPT
    ("RMSNorm", "rope", "gqa", "swiglu", False),                # Llama
    ("LayerNorm", "rope", "gqa", "gelu", False),
    ("RMSNorm", "learned_absolute", "mha", "swiglu", True),
]


def variant_name(variant) -> str:
    norm, pos, attn, mlp, bias = variant
    return "-".join([norm, "rope" if pos == "rope" else "abs", attn, mlp,
                     "bias" if bias else "nobias"])


def variant_args(variant, tp: int, sp: bool, num_layers: int = 2, preset: bool = False):
    """Megatron's validated arguments (Megatron-LM's parser under the plugin, world = TP)
    for one layer variant: the tiny model's sizes (tests.megatron_lm_ranks.TINY) with
    `preset`, else the small ones above."""
    norm, pos, attn, mlp, bias = variant
    argv = [*TINY, "--tensor-model-parallel-size", str(tp), "--train-iters", "1"]
    if not preset:
        argv += ["--num-layers", str(num_layers), "--hidden-size", str(HIDDEN),
                 "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
                 "--max-position-embeddings", str(SEQ), "--ffn-hidden-size", str(FFN),
                 "--micro-batch-size", str(BATCH)]
    argv += ["--normalization", norm, "--position-embedding-type", pos]
    if attn == "gqa":
        argv += ["--group-query-attention", "--num-query-groups", "4"]
    if mlp == "swiglu":
        argv.append("--swiglu")
    if not bias:
        argv.append("--disable-bias-linear")
    if sp:
        argv.append("--sequence-parallel")
    return parse_megatron_args(argv, world_size=tp)


def build_layers(args, perturb_seed: int = 7):
    """A stack of TransformerLayers as `pretrain()` builds them for `--transformer-impl
    local` (the TransformerConfig from Megatron's arguments, megatron-core's local spec as
    Megatron's `default_layer_spec` returns it, with the plugin's SP-safe norms on CPU); 1-D
    parameters (biases, norm weights - zero/one at init) are perturbed identically on every
    rank so that they matter in the comparison."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    layers = torch.nn.ModuleList(
        [build_module(spec, config=config, layer_number=i + 1) for i in range(args.num_layers)]
    )
    gen = torch.Generator().manual_seed(perturb_seed)
    with torch.no_grad():
        for _, param in sorted(layers.named_parameters()):
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    rotary = None
    if args.position_embedding_type == "rope":
        rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                               rotary_base=args.rotary_base, use_cpu_initialization=True)
        rotary = rope(args.seq_length)
    return config, layers, rotary


def rank_inputs(args, seed: int = 11):
    """Layer input and output gradient of this rank: the same full tensors on every rank,
    sharded along the sequence under SP (as Megatron's SP region expects)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    x, dy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if args.sequence_parallel:
        tp, rank = args.tensor_model_parallel_size, parallel_state.get_tensor_model_parallel_rank()
        x, dy = x.chunk(tp)[rank].contiguous(), dy.chunk(tp)[rank].contiguous()
    return x, dy


def clear_grads(layers):
    for param in layers.parameters():
        param.grad = None


def grads_of(layers, attr: str = "grad") -> dict:
    found = {}
    for name, param in layers.named_parameters():
        grad = getattr(param, attr)
        if grad is None:
            raise AssertionError(f"parameter {name} got no {attr}")
        found[name] = grad.detach().clone()
    return found


def megatron_path(layers, x, dy, rotary):
    """Megatron's own autograd path: each layer's forward, then loss.backward-style
    backward from the output gradient."""
    x = x.clone().requires_grad_()
    out = x
    for layer in layers:
        out, _ = layer(out, attention_mask=None, rotary_pos_emb=rotary)
    out.backward(dy)
    return out.detach(), x.grad


def program_path(stack: LayerStack, x, dy, rotary, bwd_order=None):
    out, executions = stack.forward(x.clone(), rotary_pos_emb=rotary)
    dx = stack.backward(executions, dy, bwd_order=bwd_order)
    return out, dx


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def wgrad_last_order(program) -> list:
    """The backward program with every movable op (wgrads and the all-gathers feeding only
    them) moved after all other ops."""
    fixed = [op.id for op in program.ops if not op.movable]
    return fixed + [op.id for op in program.ops if op.movable]


def random_topological_order(program, seed: int) -> list:
    """A uniformly drawn ready op at each step (Kahn with random choice)."""
    rng = random.Random(seed)
    deps = {op.id: set(op.deps) for op in program.ops}
    order = []
    while deps:
        ready = sorted(i for i, d in deps.items() if not d)
        chosen = rng.choice(ready)
        order.append(chosen)
        del deps[chosen]
        for d in deps.values():
            d.discard(chosen)
    return order


def check_variant(variant, tp: int, sp: bool) -> dict:
    """Parity of one layer variant: programs (default order, wgrads last, a random legal
    order) vs Megatron's autograd path. Returns max abs differences."""
    args = variant_args(variant, tp, sp)
    _, layers, rotary = build_layers(args)
    x, dy = rank_inputs(args)
    stack = LayerStack(list(layers), args.seq_length, args.micro_batch_size,
                       rope=rotary is not None)

    clear_grads(layers)
    ref_out, ref_dx = megatron_path(layers, x, dy, rotary)
    ref_grads = grads_of(layers)

    row = {"variant": variant_name(variant), "tp": tp, "sp": sp}
    bwd = stack.bound[0].programs.backward
    orders = {"default": None, "wgrad_last": wgrad_last_order(bwd),
              "random": random_topological_order(bwd, seed=tp * 100 + int(sp))}
    for label, order in orders.items():
        clear_grads(layers)
        out, dx = program_path(stack, x, dy, rotary, bwd_order=order)
        grads = grads_of(layers)
        row[f"out_{label}"] = float((out - ref_out).abs().max())
        row[f"dx_{label}"] = float((dx - ref_dx).abs().max())
        row[f"grad_{label}"] = max_diff(grads, ref_grads)
    row["params"] = len(ref_grads)
    row["fwd_ops"] = len(stack.bound[0].programs.forward)
    row["bwd_ops"] = len(bwd)
    return row


def ddp_check(variant, tp: int, sp: bool) -> dict:
    """Under Megatron DDP (overlap_grad_reduce): Megatron's path first (DDP records which
    grads each bucket waits for), then the programs; the programs' gradients must land in
    main_grad, clear param.grad, and make every bucket dispatch its grad sync during the
    backward - proof the DDP hooks fired for every parameter."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    args = variant_args(variant, tp, sp)
    config, layers, rotary = build_layers(args)
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=None),
        module=layers,
    )
    x, dy = rank_inputs(args)
    stack = LayerStack(list(layers), args.seq_length, args.micro_batch_size,
                       rope=rotary is not None)

    ddp.zero_grad_buffer()
    megatron_path(layers, x, dy, rotary)
    ddp.finish_grad_sync()
    ref = grads_of(layers, "main_grad")

    ddp.zero_grad_buffer()
    program_path(stack, x, dy, rotary, bwd_order=wgrad_last_order(stack.bound[0].programs.backward))
    dispatched = all(group.grad_reduce_handle is not None for group in ddp.bucket_groups)
    grads_cleared = all(p.grad is None for p in layers.parameters())
    ddp.finish_grad_sync()
    got = grads_of(layers, "main_grad")
    return {"variant": variant_name(variant), "tp": tp, "sp": sp,
            "main_grad": max_diff(got, ref), "sync_dispatched": dispatched,
            "grad_cleared": grads_cleared, "buckets": len(ddp.bucket_groups)}


def _global_buffer():
    return parallel_state.get_global_memory_buffer().buffer


def memory_check(tp: int, sp: bool, repeats: int = 15) -> dict:
    """Peak live tensor bytes of forward+backward of the tiny preset's layer stack: Megatron
    autograd vs programs, measured with `dhelix.memtrace` (compute-thread reading; the
    all-threads reading, which includes gloo's staging buffers, is reported too).

    Megatron's global memory buffer is persistent, so a peak reading does not show it: each
    path starts with an empty buffer, runs once to warm up, and the bytes its buffer then
    holds are reported and added to its total (Megatron uses it for the core-attention
    scratch and, with SP, for every all-gather; the programs only for the attention
    scratch). Both paths get the same pre-made input and output gradient; their `repeats`
    readings alternate (so both see the same load) and the smallest of each is kept: gloo's
    worker thread drops its references to a collective's tensors a moment after the wait
    returns, so on a loaded machine a reading sometimes holds one more collective buffer
    (measured on 4 ranks, 2 cores, SP: 1.011x in 22 of 24 readings, 1.022x in 2; a 1.055x
    reading failed CI once with 5 repeats and once with 9, the paths then measured one
    after the other). Every reading is in the row (`<path>_readings`)."""
    variant = COVERING_VARIANTS[0]
    args = variant_args(variant, tp, sp, preset=True)
    _, layers, rotary = build_layers(args)
    x, dy = rank_inputs(args)
    stack = LayerStack(list(layers), args.seq_length, args.micro_batch_size,
                       rope=rotary is not None)
    paths = {"megatron": lambda: megatron_path(layers, x, dy, rotary),
             "programs": lambda: program_path(stack, x, dy, rotary)}
    row = {"tp": tp, "sp": sp, "layers": args.num_layers}
    readings, persistent = {label: [] for label in paths}, {}
    for label, run in paths.items():
        _global_buffer().clear()
        clear_grads(layers)
        run()
        persistent[label] = sum(t.numel() * t.element_size()
                                for t in _global_buffer().values())
    # every path's buffer entries exist before any reading: warm up again the paths whose
    # entries were cleared for the next path's warm-up
    for run in list(paths.values())[:-1]:
        clear_grads(layers)
        run()
    for _ in range(repeats):  # the paths alternate, so both see the same load
        for label, run in paths.items():
            clear_grads(layers)
            readings[label].append(measure_peak(run)[1])
    for label in paths:
        row[f"{label}_peak"] = min(r.compute_peak_bytes for r in readings[label])
        row[f"{label}_all_threads_peak"] = min(r.peak_bytes for r in readings[label])
        row[f"{label}_persistent"] = persistent[label]
        row[f"{label}_bytes"] = row[f"{label}_peak"] + persistent[label]
        row[f"{label}_readings"] = [r.compute_peak_bytes for r in readings[label]]
    row["ratio"] = row["programs_bytes"] / row["megatron_bytes"]
    row["peak_ratio"] = row["programs_peak"] / row["megatron_peak"]
    row["all_threads_peak_ratio"] = (row["programs_all_threads_peak"]
                                     / row["megatron_all_threads_peak"])
    return row


def lifetime_check(tp: int, sp: bool) -> dict:
    """Drive one layer op by op and record what the execution holds: after the forward
    exactly the saved activations; each saved value gone right after its last backward
    reader; collectives pending until read; nothing left at the end; an op run before its
    dependencies refused; a collective whose lane is missing refused."""
    from dhelix.ops.runner import LayerExecution

    args = variant_args(COVERING_VARIANTS[0], tp, sp, num_layers=1)
    _, layers, rotary = build_layers(args)
    x, dy = rank_inputs(args)
    bound = LayerStack(list(layers), args.seq_length, args.micro_batch_size, rope=False).bound[0]
    programs = bound.programs
    execution = LayerExecution(bound)
    report = {"pending_after_comm": [], "released_late": [], "refused": None}
    execution.begin_forward(x.clone())
    for op in programs.forward.ops:
        execution.run(op.id)
        if op.kind == "comm":
            report["pending_after_comm"].append(execution.pending_values() == list(op.outputs))
    execution.end_forward()
    report["live_after_forward"] = execution.live_values()
    report["saved"] = sorted(programs.saved)
    execution.begin_backward(dy)
    first = programs.backward.ops[-1]
    try:
        execution.run(first.id)
    except RuntimeError as exc:
        report["refused"] = str(exc)
    for op in programs.backward.ops:
        execution.run(op.id)
        done = set(programs.backward.ids[: programs.backward.ids.index(op.id) + 1])
        for name in execution.live_values():
            if name in programs.saved and programs.consumers[name] <= done | set(programs.forward.ids):
                report["released_late"].append((op.id, name))
    execution.end_backward()
    report["live_after_backward"] = execution.live_values()
    # lanes attached without the one a collective needs: refused at that collective (on
    # every rank alike), never sent on the layer's own group instead
    report["missing_lane"] = None
    if programs.forward.ops and any(op.kind == "comm" for op in programs.forward.ops):
        execution = LayerExecution(bound)
        execution.lane_groups = {("tp", "no-such-channel", 0): None}
        execution.begin_forward(x.clone())
        try:
            for op in programs.forward.ops:
                execution.run(op.id)
        except RuntimeError as exc:
            report["missing_lane"] = str(exc)
    return report


HOOKED_MODULES = ("input_layernorm", "pre_mlp_layernorm", "self_attention.linear_qkv",
                  "self_attention.linear_proj", "self_attention.core_attention",
                  "mlp.linear_fc1", "mlp.linear_fc2")


def refusal_check() -> dict:
    """What binding and execution refuse, with their messages: a Transformer Engine module,
    a norm fused into the next linear (IdentityOp), a non-layer, and inputs that do not
    match the layer's description."""
    from megatron.core.transformer.identity_op import IdentityOp

    from dhelix.ops.binding import LayerBinding
    from dhelix.ops.describe import UnsupportedLayerError

    class TELayerNormColumnParallelLinear(torch.nn.Module):
        """Stand-in with the class name of TE's fused LayerNorm+QKV linear."""

    args = variant_args(COVERING_VARIANTS[0], 1, False, num_layers=1)
    _, layers, _ = build_layers(args)
    layer = layers[0]
    messages = {}

    def attempt(key, fn, errors=(UnsupportedLayerError,)):
        try:
            fn()
            messages[key] = None
        except errors as exc:
            messages[key] = f"{type(exc).__name__}: {exc}"

    for key, attr, owner, stand_in in (
        ("te", "linear_qkv", layer.self_attention, TELayerNormColumnParallelLinear()),
        ("fused_norm", "input_layernorm", layer, IdentityOp()),
    ):
        original = getattr(owner, attr)
        setattr(owner, attr, stand_in)
        attempt(key, lambda: LayerBinding(layer))
        setattr(owner, attr, original)
    attempt("not_a_layer", lambda: LayerBinding(torch.nn.Linear(2, 2)))
    bound = LayerStack([layer], args.seq_length, args.micro_batch_size, rope=False).bound[0]
    x, _ = rank_inputs(args)
    runtime = (ValueError, RuntimeError)
    attempt("needs_grad_input",
            lambda: bound.new_execution().begin_forward(x.clone().requires_grad_()), runtime)
    attempt("wrong_shape", lambda: bound.new_execution().begin_forward(x[:-1].clone()), runtime)
    attempt("rope_mismatch", lambda: bound.new_execution().begin_forward(
        x.clone(), rotary_pos_emb=torch.zeros(1)), runtime)

    # Forward pre-hooks (Megatron DDP waits for parameter all-gathers in them) fire once per
    # module per forward, for the linears the programs call directly too.
    fired = {}
    handles = [module.register_forward_pre_hook(
        lambda mod, _args, name=name: fired.__setitem__(name, fired.get(name, 0) + 1))
        for name, module in layer.named_modules() if name in HOOKED_MODULES]
    execution = bound.new_execution()
    from dhelix.ops.runner import run_forward

    run_forward(execution, x.clone())
    for handle in handles:
        handle.remove()
    messages["pre_hooks_fired"] = fired
    return messages


def run_checks(ctx, tp: int, sp_options, variants, ddp_variants=(), memory=(),
               lifetime=(), refusals: bool = False) -> dict:
    """One launch: parity of every variant for each SP setting, DDP checks, memory checks,
    lifetime checks. Returns (on every rank) this rank's rows."""
    torch.set_num_threads(1)
    variants = [tuple(v) for v in variants]
    result = {"rank": dist.get_rank(), "parity": [], "ddp": [], "memory": [], "lifetime": [],
              "refusals": refusal_check() if refusals else None}
    for sp in lifetime:
        result["lifetime"].append(lifetime_check(tp, sp))
    for sp in sp_options:
        for variant in variants:
            result["parity"].append(check_variant(variant, tp, sp))
    for variant, sp in ddp_variants:
        result["ddp"].append(ddp_check(tuple(variant), tp, sp))
    for sp in memory:
        result["memory"].append(memory_check(tp, sp))
    return result


# One launch per world size (TP = world size, DP = 1), shared by tests/ops/test_parity.py
# and scripts/ops_report.py.
LAUNCHES = {
    1: dict(sp_options=[False], variants=ALL_VARIANTS,
            ddp_variants=[(COVERING_VARIANTS[0], False)], memory=[False], lifetime=[False],
            refusals=True),
    2: dict(sp_options=[False, True], variants=ALL_VARIANTS,
            ddp_variants=[(COVERING_VARIANTS[1], True), (COVERING_VARIANTS[0], False)],
            memory=[True, False], lifetime=[True, False]),
    4: dict(sp_options=[False, True], variants=ALL_VARIANTS,
            ddp_variants=[(COVERING_VARIANTS[1], True)], memory=[True], lifetime=[True]),
}


def launch(world: int) -> list:
    """Run the checks of `LAUNCHES[world]` on `world` gloo ranks; per-rank results."""
    from dhelix.harness import run_megatron_ranks

    return run_megatron_ranks(run_checks, world, world, tp=world, timeout_s=300,
                              env={"OMP_NUM_THREADS": "1"}, **LAUNCHES[world])
