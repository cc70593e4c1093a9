"""Calibrate the GPU emulation against the measured H100 step (docs/gpu_emulation.md).

First traces the profile's operators at the profile's layer shape
(`dhelix.gpu_emulation.profile_fit.trace_profile_layer`) and fits the kernel model at the traced bytes
(printing each profile entry measured vs modelled). Then runs megatron-core's GPTModel (local
spec, one rank on CPU) at the Llama-8B layer shape (hidden 4096, FFN 14336, 32 heads, 8
groups, seq 4096, bf16, micro-batch 1, 8 micro-batches, vocabulary 32000, untied output
layer, SGD on the bf16 parameters) under `GpuEmulationMode` with the core attention charged
as a region (`dhelix.gpu_emulation.regions`), with each `--schedules` entry (Megatron's own
`forward_backward_no_pipelining`; dhelix's engine for `--dhelix --dhelix-pairer sequential`)
and each `--num-layers` (the H100 run had 4; fewer fit this machine's memory), and prints per
run the modelled step (sum of kernel times: what the GPU stream would take if the host keeps
up), the wall time / S, and the modelled time per term and per aten operator; then the
step extrapolated linearly in the layer count to `--target-layers`, against the measured
885-893 ms (stock) and 898-930 ms (`--dhelix` sequential). TIMING ONLY: the weights are never
initialised (the model is built under the mode).

`--layer-config step` (default) runs the configuration the measured step ran (Megatron-LM's
`core_transformer_config_from_args` and `Float16Module`): a bf16 softmax
(`attention_softmax_in_fp32=False`, charged at the profile's attention rescaled to the
bf16-softmax bytes, `kernel_model.CoreAttentionTrace`) and bf16 norm weights (one fused
kernel per norm, `regions.fused_rms_norms`); `profile` runs the profiled layer's (fp32
softmax, fp32 norm weights). `--host-latency zero-kernel` takes the latency measured by the
profile's zero-kernel entries off its memory-bound and attention entries
(`kernel_model.zero_kernel_latency_ms`); a number, that many ms; 0 none.

    PYTHONPATH=. flock /tmp/dhelix-heavy.lock python scripts/gpu_emulation_calibrate.py \\
        --profile /work/shared/measurements/h100_llama8b_layer_comp_only_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# measured ms per iteration, 4 Llama-8B layers on one H100 (DESIGN.md, issue #24)
MEASURED_H100_STEP_MS = {"megatron": (885.0, 893.0), "dhelix-sequential": (898.0, 930.0)}
SCHEDULES = tuple(MEASURED_H100_STEP_MS)


SEQ, VOCAB = 4096, 32000
LAYER_CONFIGS = ("step", "profile")


def h100_layer_config(profile_path, num_layers, softmax_in_fp32=True):
    """The profiled H100 layer's TransformerConfig (`profile_fit.layer_config`: Llama-8B
    layers, local spec, unfused; fp32 softmax as `dhelix profile` builds it; the norm weights
    stay fp32 unless the caller casts the model as Float16Module does)."""
    from dhelix.gpu_emulation.profile_fit import layer_config, profile_layer
    from profiler.profile_file import load_profile

    return layer_config(profile_layer(load_profile(profile_path)), num_layers, softmax_in_fp32)


def _dhelix_sequential(gpt, num_layers, micro_batches):
    """dhelix's forward_backward_func for `gpt` (`--dhelix --dhelix-pairer sequential`:
    the operator path, one micro-batch after another, no pairs)."""
    from dhelix.options import DHelixOptions, DHelixRun, ModelShape, ParallelLayout
    from dhelix.parallel import Job
    from dhelix.runtime.setup import setup_dhelix

    run = DHelixRun(
        DHelixOptions(enabled=True, pairer="sequential"),
        ModelShape(num_layers=num_layers, hidden_size=4096, ffn_hidden_size=14336,
                   num_attention_heads=32, num_query_groups=8, seq_length=SEQ,
                   vocab_size=VOCAB, normalization="RMSNorm", position_embedding_type="rope",
                   swiglu=True, add_bias_linear=False, dtype="bf16", hidden_dropout=0.0,
                   attention_dropout=0.0),
        ParallelLayout(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                       data_parallel_size=1, sequence_parallel=False, micro_batch_size=1,
                       global_batch_size=micro_batches))
    return setup_dhelix(run, [gpt], Job()).forward_backward_func


def _step(ctx, profile_path, trace, host_latency, layer_config, num_layers, time_scale,
          micro_batches, schedule):
    import contextlib
    import time

    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from dhelix.gpu_emulation.mode import EmulationConfig, GpuEmulationMode
    from dhelix.gpu_emulation.profile_fit import fit_emulation_model
    from dhelix.gpu_emulation.regions import attention_regions, fused_rms_norms
    from profiler.profile_file import load_profile

    model_fit = fit_emulation_model(load_profile(profile_path), trace, host_latency)
    seq, vocab = SEQ, VOCAB
    step_config = layer_config == "step"
    with GpuEmulationMode(model_fit, EmulationConfig(time_scale=1e-9)):  # no init compute
        gpt = GPTModel(config=h100_layer_config(profile_path, num_layers,
                                                softmax_in_fp32=not step_config),
                       transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                       vocab_size=vocab, max_sequence_length=seq,
                       share_embeddings_and_output_weights=False, position_embedding_type="rope")
        if step_config:
            gpt.bfloat16()  # what Float16Module does to a --bf16 model: norm weights bf16
    optimizer = torch.optim.SGD(gpt.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (1, seq))
    positions = torch.arange(seq).unsqueeze(0)

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None, labels=tokens)

        def loss_func(losses):
            loss = losses.float().mean()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func

    forward_backward = forward_backward_no_pipelining
    if schedule == "dhelix-sequential":
        with GpuEmulationMode(model_fit, EmulationConfig(time_scale=1e-9)):
            forward_backward = _dhelix_sequential(gpt, num_layers, micro_batches)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward(
            forward_step_func=forward_step, data_iterator=None, model=[gpt],
            num_microbatches=micro_batches, seq_length=seq, micro_batch_size=1,
            forward_only=False)
        optimizer.step()

    with attention_regions(gpt), fused_rms_norms() if step_config else (
            contextlib.nullcontext()):
        with GpuEmulationMode(model_fit, EmulationConfig(time_scale=time_scale)):
            train_step()  # warm-up: first-call host costs
        mode = GpuEmulationMode(model_fit, EmulationConfig(time_scale=time_scale))
        wall, cpu = time.perf_counter(), time.process_time()
        with mode:
            train_step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    report = mode.report()
    return {"schedule": schedule, "engine": forward_backward.__qualname__,
            "layer_config": layer_config, "host_latency_ms": model_fit.host_latency_ms,
            "num_layers": num_layers, "modelled_ms": report.modelled_ms,
            "wall_ms_over_S": wall * 1000 / time_scale, "cpu_s": cpu, "wall_s": wall,
            "ran_for_real": report.ran_for_real, "absorbed": report.absorbed,
            "by_term": {k: [v.count, v.modelled_ms] for k, v in report.by_term.items()},
            "by_op": {k: [v.count, v.modelled_ms] for k, v in report.by_op.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--num-layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--target-layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES),
                        help="megatron: its forward_backward_no_pipelining; dhelix-sequential: "
                             "--dhelix --dhelix-pairer sequential's engine")
    parser.add_argument("--layer-config", choices=LAYER_CONFIGS, default="step",
                        help="step: the measured step's bf16 softmax and bf16 norm weights; "
                             "profile: the profiled layer's fp32 softmax and fp32 norm weights")
    parser.add_argument("--host-latency", default="zero-kernel",
                        help="ms taken off the profile's memory-bound and attention entries; "
                             "zero-kernel: measured by its entries that issue no kernel")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    if len(set(args.num_layers)) < 2:
        parser.error("error: give two or more different --num-layers to extrapolate")
    if args.host_latency != "zero-kernel":
        try:
            float(args.host_latency)
        except ValueError:
            parser.error(f"error: --host-latency must be zero-kernel or ms, got {args.host_latency!r}")
    from dhelix.gpu_emulation.profile_fit import fit_emulation_model, trace_profile_layer
    from dhelix.harness import run_megatron_ranks
    from profiler.profile_file import load_profile

    env = {"OMP_NUM_THREADS": "1"}
    trace = run_megatron_ranks(trace_profile_layer, 1, args.profile, timeout_s=600, env=env)[0]
    model = fit_emulation_model(load_profile(args.profile), trace, args.host_latency)
    _print_fit(load_profile(args.profile), model, trace["operators"])
    runs, results = [], {}
    for schedule in args.schedules:
        for n in sorted(set(args.num_layers)):
            runs.append(run_megatron_ranks(_step, 1, args.profile, trace, args.host_latency,
                                           args.layer_config, n, args.time_scale,
                                           args.micro_batches, schedule, timeout_s=1800,
                                           env=env)[0])
            _print_run(runs[-1], args.time_scale)
    for schedule in args.schedules:
        lo, hi = MEASURED_H100_STEP_MS[schedule]
        first, *_, last = [r for r in runs if r["schedule"] == schedule]
        per_layer = (last["modelled_ms"] - first["modelled_ms"]) / (
            last["num_layers"] - first["num_layers"])
        target = first["modelled_ms"] + per_layer * (args.target_layers - first["num_layers"])
        results[schedule] = {"target_ms": target, "per_layer_ms": per_layer}
        print(f"\n{schedule}: per layer ({args.micro_batches} micro-batches) {per_layer:.1f} ms; "
              f"rest of the step {first['modelled_ms'] - per_layer * first['num_layers']:.1f} ms")
        print(f"{schedule}: {args.target_layers} layers modelled {target:.1f} ms; measured "
              f"{lo:.0f}-{hi:.0f} ms on one H100 ({target / ((lo + hi) / 2) - 1:+.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "results": results,
                                               "trace": trace}, indent=1))
    return 0


def _print_run(run, time_scale) -> None:
    print(f"\n{run['schedule']} ({run['engine']}), {run['num_layers']} layer(s): modelled step "
          f"{run['modelled_ms']:.1f} ms, wall/S {run['wall_ms_over_S']:.1f} ms (S={time_scale}), "
          f"CPU {run['cpu_s']:.1f} s, {run['ran_for_real']} compute ops ran for real, "
          f"{run['absorbed']} absorbed in regions")
    for name, (count, ms) in sorted(run["by_term"].items(), key=lambda kv: -kv[1][1]):
        print(f"  term {name:24s} {count:6d} kernels {ms:9.1f} ms")
    for name, (count, ms) in sorted(run["by_op"].items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  op   {name:40s} {count:6d} {ms:9.1f} ms")


def _print_fit(profile, model, traced) -> None:
    """The fit at traced bytes: the host latency, the bandwidth, the attention rates, and
    each profile entry measured vs modelled."""
    print(f"host latency taken off the memory-bound and attention entries: "
          f"{model.host_latency_ms:.3f} ms")
    print(f"memory-bound bandwidth at traced bytes: {model.bandwidth['elementwise'] / 1e6:.0f} "
          "GB/s")
    for (kernel, phase), rate in sorted(model.attention.items()):
        print(f"  attention {kernel:22s} {phase}: {rate / 1e9:7.1f} TFLOP/s")
    print(f"  {'profile entry':78s} {'instances':>9s} {'traced MB':>10s} {'measured':>9s} "
          f"{'modelled':>9s}")
    for key, measured in sorted(profile.solo.items()):
        if key in model.fitted_from:
            nbytes = traced.get(key, ())
            mean_mb = sum(nbytes) / len(nbytes) / 1e6 if nbytes else 0.0
            print(f"  {key:78s} {len(nbytes):9d} {mean_mb:10.1f} {measured:9.3f} "
                  f"{model.solo_ms(key):9.3f}")


if __name__ == "__main__":
    sys.exit(main())
