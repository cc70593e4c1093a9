"""`dhelix ops`: the operator table of one transformer layer for a model/parallel config.

    dhelix ops [--preset NAME|FILE] <Megatron arguments> [--ranks-per-node N]
               [--world-size W] [--rank 0] [--layer 0] [--direction fwd|bwd|both] [--json]
               [--export-dag DIR]
    e.g. dhelix ops --preset tiny --hidden-dropout 0 --attention-dropout 0
               --tensor-model-parallel-size 4 --sequence-parallel --ranks-per-node 2

Model and parallel arguments are Megatron's, parsed and validated by Megatron-LM's parser
with the plugin's `--dhelix*` options (`megatron_patches.parsed_arguments`), as for
pretraining under the plugin; `--preset` expands to Megatron arguments as for `dhelix train`.
Nothing is launched: the programs come from the layer description of the TransformerConfig
`pretrain()` would build, exactly as the runtime builds them.
`--export-dag DIR` writes DIR/fwd.json and DIR/bwd.json in the shared `dhelix-dag` format.
With MoE (`--num-experts`), `--layer` picks the layer of a `--moe-layer-freq` stack: an MoE
layer's MLP is the router, the token-count exchange, the dispatch and combine all-to-alls
on the expert-parallel group's channel, the permutations and the experts
(docs/operator_programs.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "ops", help="print a transformer layer's forward/backward operator programs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=True,
    )
    parser.add_argument("--preset", default=None,
                        help="model preset expanded to Megatron arguments: a name in configs/ "
                             "(e.g. tiny) or a JSON file path (as for `dhelix train`)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="node size for the intra/inter channel decision (default: "
                        "$DHELIX_RANKS_PER_NODE, else $LOCAL_WORLD_SIZE, else one node)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="world size to validate the arguments against (default: TP x PP x "
                        "CP)")
    parser.add_argument("--rank", type=int, default=0,
                        help="the rank whose tensor-parallel group is shown (default 0)")
    parser.add_argument("--layer", type=int, default=0,
                        help="the decoder layer shown (0-based, default 0): with MoE, "
                             "--moe-layer-freq makes it an MoE or a dense layer")
    parser.add_argument("--direction", choices=["fwd", "bwd", "both"], default="both")
    parser.add_argument("--json", action="store_true", help="print the DAGs as JSON")
    parser.add_argument("--export-dag", metavar="DIR", default=None,
                        help="write DIR/fwd.json and DIR/bwd.json (dhelix-dag format)")
    parser.set_defaults(func=run, pass_through=True)


def _model_args(args):
    """Megatron's validated arguments for the command line (the preset expanded first)."""
    from dhelix.launch import preset_arguments
    from megatron_patches.parsed_arguments import parse_megatron_args

    rest = list(args.extra_args)
    if args.preset:
        rest = preset_arguments(args.preset, rest) + rest
    return parse_megatron_args(rest, args.world_size)


def format_table(program) -> str:
    """The operators of one program as an aligned text table, in program order."""
    rows = [("id", "kind", "channel", "class", "movable", "deps", "cost key")]
    for op in program.ops:
        rows.append((op.id, op.kind, op.channel, op.op_class, "yes" if op.movable else "",
                     ",".join(op.deps) or "-", op.cost_key))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def saved_summary(programs) -> str:
    """The activations the forward leaves for the backward, with their sizes."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(programs.description.dtype, 4)
    parts, total = [], 0
    for name in programs.saved:
        info = programs.values[name]
        if info.kind == "tensor":
            size = itemsize
            for dim in info.shape:
                size *= getattr(dim, "high", dim)  # a variable dimension at its bound
            total += size
            parts.append(f"{name} {'x'.join(map(str, info.shape))}")
        elif info.kind == "graph":
            parts.append(f"{name} (autograd graph)")
        else:
            parts.append(f"{name} (run-time metadata)")
    return (f"saved for backward: {', '.join(parts)}; explicit tensors "
            f"{total / 2**20:.2f} MiB (graphs hold the norm/attention/activation internals)")


def _stack_line(model_args) -> str:
    """'' for a stack of identical layers; else which layers are MoE and which dense."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    from dhelix.ops.moe_describe import moe_layer_pattern

    pattern = moe_layer_pattern(core_transformer_config_from_args(model_args))
    if len(set(pattern)) < 2:
        return ""
    moe = [i for i, kind in enumerate(pattern) if kind]
    dense = [i for i, kind in enumerate(pattern) if not kind]
    return (f"stack: MoE layers {moe}, dense layers {dense} (--layer N shows layer N; "
            "--dhelix plans each forward/backward layer pair)")


def run(args) -> int:
    import warnings

    # megatron-core warns at import about optional GPU packages; irrelevant to a table.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from dhelix.argument_error import ArgumentError
    from dhelix.ops.describe import LayerDescription, UnsupportedLayerError
    from dhelix.ops.layer_program import build_layer_programs
    from dhelix.topology import NodeTopology

    try:
        model_args = _model_args(args)
        topology = NodeTopology.detect(args.ranks_per_node)
        desc = LayerDescription.from_args(model_args, topology=topology, rank=args.rank,
                                          layer=args.layer)
        programs = build_layer_programs(desc)
        stack = _stack_line(model_args)
    except SystemExit as exc:  # Megatron's or the plugin's `error:` line is printed
        return exc.code if isinstance(exc.code, int) else 2
    except (ArgumentError, UnsupportedLayerError, ValueError) as exc:
        print(f"dhelix ops: error: {exc}", file=sys.stderr)
        return 2
    directions = ["fwd", "bwd"] if args.direction == "both" else [args.direction]
    if args.export_dag:
        out = Path(args.export_dag)
        for direction in ("fwd", "bwd"):
            programs.program(direction).save_dag(out / f"{direction}.json")
    if args.json:
        print(json.dumps({d: programs.program(d).dag().to_dict() for d in directions}, indent=1))
        return 0
    print(f"layer {args.layer}: {desc.summary()}")
    if stack:
        print(stack)
    for direction in directions:
        program = programs.program(direction)
        title = {"fwd": "forward", "bwd": "backward"}[direction]
        print(f"\n{title} program: {len(program)} operators")
        print(format_table(program))
    print("\n" + saved_summary(programs))
    if args.export_dag and stack:
        out = Path(args.export_dag)
        print(f"wrote {out / 'fwd.json'} and {out / 'bwd.json'} (layer {args.layer}); a stack "
              "of MoE and dense layers is planned layer pair by layer pair at --dhelix "
              "start-up, not from a plan file")
    elif args.export_dag:
        from dhelix.run_fingerprint import model_fingerprint, parallel_fingerprint
        from megatron_patches.run_options import run_from_megatron_args

        run = run_from_megatron_args(model_args)  # as --dhelix start-up computes them
        out = Path(args.export_dag)
        print(f"wrote {out / 'fwd.json'} and {out / 'bwd.json'}; plan this run with:")
        print("  " + shlex.join([
            "dhelix", "plan", "--fwd-dag", str(out / "fwd.json"), "--bwd-dag",
            str(out / "bwd.json"), "--model", model_fingerprint(run), "--parallel",
            parallel_fingerprint(run), "-o", "plan.json"]) + "  [--profile PROFILE]")
    return 0
