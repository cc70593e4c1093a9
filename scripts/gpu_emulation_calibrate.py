"""Calibrate the GPU emulation against the measured H100 step (docs/gpu_emulation.md).

Runs stock Megatron (megatron-core's GPTModel, local spec, and its own
`forward_backward_no_pipelining`, one rank on CPU) at the Llama-8B layer shape (hidden 4096,
FFN 14336, 32 heads, 8 groups, seq 4096, bf16, micro-batch 1, 8 micro-batches, vocabulary
32000, untied output layer, SGD on the bf16 parameters) under `GpuEmulationMode`, for each
`--num-layers` given (the H100 run had 4; fewer fit this machine's memory), and prints per
run the modelled step (sum of kernel times: what the GPU stream would take if the host keeps
up), the wall time / S, and the modelled time per term and per aten operator; then the
step extrapolated linearly in the layer count to `--target-layers`, against the measured
885-893 ms. TIMING ONLY: the weights are never initialised (the model is built under the mode).

    PYTHONPATH=. flock /tmp/dhelix-heavy.lock python scripts/gpu_emulation_calibrate.py \\
        --profile /work/shared/measurements/h100_llama8b_layer_comp_only_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MEASURED_H100_STEP_MS = (885.0, 893.0)  # DESIGN.md: 4 Llama-8B layers, stock, one H100


def _step(ctx, profile_path, num_layers, time_scale, micro_batches):
    import time

    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.transformer import TransformerConfig

    from dhelix.gpu_emulation.kernel_model import fit_kernel_model
    from dhelix.gpu_emulation.mode import EmulationConfig, GpuEmulationMode
    from profiler.profile_file import load_profile

    model_fit = fit_kernel_model(load_profile(profile_path))
    seq, vocab = 4096, 32000
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    with GpuEmulationMode(model_fit, EmulationConfig(time_scale=1e-6)):  # no init compute
        gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="RMSNorm"), vocab_size=vocab, max_sequence_length=seq,
            share_embeddings_and_output_weights=False, position_embedding_type="rope")
    optimizer = torch.optim.SGD(gpt.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (1, seq))
    positions = torch.arange(seq).unsqueeze(0)

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None, labels=tokens)

        def loss_func(losses):
            loss = losses.float().mean()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=None, model=[gpt],
            num_microbatches=micro_batches, seq_length=seq, micro_batch_size=1,
            forward_only=False)
        optimizer.step()

    with GpuEmulationMode(model_fit, EmulationConfig(time_scale=time_scale)):
        train_step()  # warm-up: first-call host costs
    mode = GpuEmulationMode(model_fit, EmulationConfig(time_scale=time_scale))
    wall, cpu = time.perf_counter(), time.process_time()
    with mode:
        train_step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    report = mode.report()
    return {"num_layers": num_layers, "modelled_ms": report.modelled_ms,
            "wall_ms_over_S": wall * 1000 / time_scale, "cpu_s": cpu, "wall_s": wall,
            "ran_for_real": report.ran_for_real,
            "by_term": {k: [v.count, v.modelled_ms] for k, v in report.by_term.items()},
            "by_op": {k: [v.count, v.modelled_ms] for k, v in report.by_op.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--num-layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--target-layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    if len(set(args.num_layers)) < 2:
        parser.error("error: give two or more different --num-layers to extrapolate")
    from dhelix.harness import run_megatron_ranks

    runs = [run_megatron_ranks(_step, 1, args.profile, n, args.time_scale, args.micro_batches,
                               timeout_s=1800, env={"OMP_NUM_THREADS": "1"})[0]
            for n in sorted(set(args.num_layers))]
    for run in runs:
        print(f"\n{run['num_layers']} layer(s): modelled step {run['modelled_ms']:.1f} ms, "
              f"wall/S {run['wall_ms_over_S']:.1f} ms (S={args.time_scale}), "
              f"CPU {run['cpu_s']:.1f} s, {run['ran_for_real']} compute ops ran for real")
        for name, (count, ms) in sorted(run["by_term"].items(), key=lambda kv: -kv[1][1]):
            print(f"  term {name:24s} {count:6d} kernels {ms:9.1f} ms")
        for name, (count, ms) in sorted(run["by_op"].items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"  op   {name:40s} {count:6d} {ms:9.1f} ms")
    first, last = runs[0], runs[-1]
    per_layer = (last["modelled_ms"] - first["modelled_ms"]) / (
        last["num_layers"] - first["num_layers"])
    target = first["modelled_ms"] + per_layer * (args.target_layers - first["num_layers"])
    lo, hi = MEASURED_H100_STEP_MS
    print(f"\nper layer (8 micro-batches): {per_layer:.1f} ms; rest of the step "
          f"{first['modelled_ms'] - per_layer * first['num_layers']:.1f} ms")
    print(f"{args.target_layers} layers: modelled {target:.1f} ms vs measured {lo:.0f}-{hi:.0f} ms "
          f"on one H100 ({target / ((lo + hi) / 2) - 1:+.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "target_ms": target,
                                               "per_layer_ms": per_layer}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
