#!/usr/bin/env python
"""One-GPU benchmark: stock Megatron with its local spec, stock Megatron with the SDPA
attention spec, and the `--dhelix` runtime (sequential pairer and DP plan), side by side in
one run, repetitions interleaved (A B C D A B C D ...) so machine noise hits every row
alike. Prints one table.

    PYTHONPATH=/tmp/site:. python scripts/bench_gpu.py                 # Llama-8B-shaped
    PYTHONPATH=. .venv/bin/python scripts/bench_gpu.py --quick         # tiny model, CPU

Every row is `scripts/pretrain_gpt.py` set up by `megatron.training.pretrain` under the plugin
(megatron-core's model, optimizer and, without `--dhelix`, schedule; stepped by Megatron's own
`train_step`, `megatron_patches.step_harness`) from the same seed in one process
(`scripts.bench_dhelix_pp1.build_runs`), so the same initial weights and data: the loss of every row is checked to be equal at every
repetition (and printed). Per row: step time min / median / max over the measured
repetitions (CUDA events on CUDA; wall clock on CPU, labelled), TFLOP/s per GPU by
Megatron's own count (`megatron.training.training.num_floating_point_operations`) and, on
CUDA, the step's peak memory above what was allocated before it
(`torch.cuda.max_memory_allocated`; every row's model and optimizer stay resident, so
absolute readings would count the other rows' state). See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dhelix.bench.systems import tiny_model  # noqa: E402 (after the path insert)

# 4 Llama-8B-shaped layers (configs/llama8b.json as Megatron arguments), bf16. The vocabulary
# is cut to 32000 and the optimizer is SGD so that four rows' weights, fp32 main weights and
# gradients (~11 GB each) fit one 80 GB GPU. Every row adds `dhelix.bench.systems.RUN_ARGS`
# (mock data, no dropout, no evaluation) before the model's arguments.
DEFAULT_MODEL = ["--num-layers", "4", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                 "--num-attention-heads", "32", "--group-query-attention",
                 "--num-query-groups", "8", "--seq-length", "4096",
                 "--max-position-embeddings", "8192", "--swiglu", "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--rotary-base", "500000",
                 "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "8",
                 "--optimizer", "sgd", "--bf16"]
QUICK_MODEL = tiny_model(num_layers=2, global_batch_size=4)
# |loss - loss of the stock row with the same attention| (same operations, other order)
# and |loss(stock, SDPA) - loss(stock, Megatron's attention)| (other attention kernels).
LOSS_TOLERANCE = {"fp32": {"same": 1e-5, "cross": 1e-4},
                  "bf16": {"same": 1e-3, "cross": 5e-2}}


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    args: tuple
    attention: str


# Every row's data loader builds no [b, 1, s, s] attention mask: SDPA and the --dhelix
# operators apply the causal mask inside the kernel and never read it, and Megatron's own
# attention builds its causal mask when it gets none (`FusedScaleMaskSoftmax`). Megatron's
# default (a 16 MB bool mask per sample at seq 4096, stacked on the host and copied to the
# GPU every micro-batch) is `--dataloader-mask`.
NO_DATALOADER_MASK = ("--no-create-attention-mask-in-dataloader",)


def rows_for(dhelix_attention: str, dhelix_profile: str | None = None,
             dataloader_mask: bool = False) -> tuple:
    """The benchmark's rows; the `--dhelix` rows use `dhelix_attention`, the dp row plans
    from `dhelix_profile` when one is given (else from analytic costs); every row's data
    loader builds attention masks only with `dataloader_mask`."""
    dhelix = ("--dhelix-attention", dhelix_attention)
    planned = ("--dhelix-profile", dhelix_profile) if dhelix_profile else ()
    data = () if dataloader_mask else NO_DATALOADER_MASK
    return (
        Row("stock", "stock Megatron, local spec", ("--dhelix-attention", "megatron", *data),
            "megatron"),
        Row("stock_sdpa", "stock Megatron, SDPA spec", ("--dhelix-attention", "sdpa", *data),
            "sdpa"),
        Row("dhelix_sequential", "--dhelix sequential",
            ("--dhelix", "--dhelix-pairer", "sequential", *dhelix, *data), dhelix_attention),
        Row("dhelix_dp", "--dhelix dp" + (" (profile)" if dhelix_profile else ""),
            ("--dhelix", "--dhelix-pairer", "dp", *dhelix, *planned, *data), dhelix_attention),
    )


class StepTimer:
    """Seconds of one call: CUDA events on CUDA (the GPU's time between two points of the
    stream, the call included), wall clock (`time.perf_counter`) on CPU."""

    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        self.kind = "CUDA events" if self.cuda else "wall clock"

    def time(self, fn):
        import torch

        if not self.cuda:
            start = time.perf_counter()
            result = fn()
            return result, time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end) / 1e3


def megatron_flops_per_step(args) -> float:
    """Megatron's FLOP count of one global batch for the run whose Megatron arguments are
    `args` (`megatron.training.training.num_floating_point_operations`)."""
    from megatron.training.training import num_floating_point_operations

    return float(num_floating_point_operations(args, args.global_batch_size))


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def traced_step(run, path: Path) -> tuple:
    """One training step of `run` under torch.profiler (CPU and, on CUDA, device activity),
    its Chrome trace written to `path` (gzipped when the name ends in .gz); returns the
    step's outcome and the trace's `dhelix.bench.gpu_kernels.KernelSummary` as a dict."""
    import dataclasses
    import gzip
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    from dhelix.bench.gpu_kernels import summarise_trace

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        outcome = run.train_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        text = raw.read_text()
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt") as out:
        out.write(text)
    return outcome, dataclasses.asdict(summarise_trace(json.loads(text)))


def bench_body(ctx, megatron_args: list, rows: list, reps: int, warmup: int,
               trace_dir: str | None = None) -> dict:
    """Every rank: build one run per row (`scripts.bench_dhelix_pp1.build_runs`), then
    `warmup` + `reps` rounds of one training step (Megatron's `train_step`) of every row in
    turn. Returns this rank's per-row step seconds and losses (every round, warm-up
    included: the rows train in lockstep from the same weights), step peak bytes above the
    resident ones (CUDA; None on CPU), the FLOPs per step and the device. With `trace_dir`,
    one more round traces each row's step (`traced_step`: TRACE_DIR/ROW.trace.json.gz and
    the row's kernel summary under "kernels"; not timed with the others). Closes the runs."""
    import torch
    import torch.distributed as dist

    from megatron_patches.step_harness import close_all_runs
    from scripts.bench_dhelix_pp1 import build_runs

    runs = build_runs(megatron_args, {r.name: list(r.args) for r in rows})
    timer = StepTimer()
    times = {name: [] for name in runs}
    losses = {name: [] for name in runs}
    peak = {name: None for name in runs}
    for i in range(warmup + reps):
        for name, run in runs.items():
            dist.barrier()
            if timer.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            outcome, seconds = timer.time(run.train_step)
            losses[name].append(float(outcome.loss_dict["lm loss"]))
            if i >= warmup:
                times[name].append(seconds)
                if timer.cuda:
                    step_peak = torch.cuda.max_memory_allocated() - resident
                    peak[name] = max(peak[name] or 0, step_peak)
    kernels = {}
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        for name, run in runs.items():
            dist.barrier()
            outcome, kernels[name] = traced_step(run, Path(trace_dir) / f"{name}.trace.json.gz")
            losses[name].append(float(outcome.loss_dict["lm loss"]))
    first = next(iter(runs.values())).args
    result = {"rank": ctx.rank, "times": times, "losses": losses, "peak_bytes": peak,
              "kernels": kernels,
              "timing": timer.kind, "device": device_name(),
              "flops_per_step": megatron_flops_per_step(first),
              "world_size": dist.get_world_size(), "bf16": bool(first.bf16)}
    close_all_runs()
    return result


def check_losses(rows: list, losses: dict, bf16: bool) -> list:
    """One line per failed check (empty: every row's loss equals its reference within the
    stated tolerance at every repetition). Reference: the stock row with the same
    attention; the two stock rows are compared with the cross-attention tolerance."""
    tol = LOSS_TOLERANCE["bf16" if bf16 else "fp32"]
    stock_of = {"megatron": "stock", "sdpa": "stock_sdpa"}
    problems = []
    pairs = [(r.name, stock_of[r.attention], tol["same"]) for r in rows
             if r.name != stock_of[r.attention]]
    pairs.append(("stock_sdpa", "stock", tol["cross"]))
    for name, reference, bound in pairs:
        for i, (a, b) in enumerate(zip(losses[name], losses[reference])):
            if not abs(a - b) <= bound:
                problems.append(f"{name} vs {reference}, step {i + 1}: loss {a:.6f} vs "
                                f"{b:.6f}, |diff| {abs(a - b):.2e} > {bound:g}")
    return problems


def summarise(rows: list, results: list) -> dict:
    """The table's numbers: per row the slowest rank's step time per repetition (min /
    median / max), TFLOP/s per GPU at the median, the largest step peak over the ranks,
    the losses (rank 0), and the loss check."""
    r0 = results[0]
    table = []
    for row in rows:
        per_rep = [max(rep) for rep in zip(*(r["times"][row.name] for r in results))]
        median = statistics.median(per_rep)
        peaks = [r["peak_bytes"][row.name] for r in results]
        table.append({
            "row": row.name, "label": row.label, "attention": row.attention,
            "args": list(row.args),
            "step_s_min_median_max": (min(per_rep), median, max(per_rep)),
            "tflops_per_gpu": r0["flops_per_step"] / median / r0["world_size"] / 1e12,
            "peak_bytes": None if None in peaks else max(peaks),
            "losses": r0["losses"][row.name], "kernels": r0["kernels"].get(row.name)})
    problems = check_losses(rows, r0["losses"], r0["bf16"])
    return {"device": r0["device"], "timing": r0["timing"], "rows": table,
            "loss_check": problems, "flops_per_step": r0["flops_per_step"]}


def table(summary: dict, megatron_args: list, reps: int, warmup: int) -> str:
    from dhelix.bench.report import _fmt

    lines = [f"Device: {summary['device']}; timing: {summary['timing']}; {reps} measured "
             f"repetitions after {warmup} warm-up, interleaved across rows.",
             f"Model: {' '.join(megatron_args)}", "",
             "| row | attention | step ms min / median / max | TFLOP/s per GPU or rank (Megatron's "
             "count) | step peak memory (MiB, torch.cuda.max_memory_allocated) | losses |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for row in summary["rows"]:
        low, median, high = (t * 1e3 for t in row["step_s_min_median_max"])
        peak = row["peak_bytes"]
        lines.append(f"| {row['label']} | {row['attention']} | {low:.1f} / {median:.1f} / "
                     f"{high:.1f} | {row['tflops_per_gpu']:.3g} | "
                     f"{_fmt(peak and peak / 2**20, '{:.0f}', 'n/a (CPU)')} | "
                     + ", ".join(f"{x:.6f}" for x in row["losses"]) + " |")
    lines += ["", "Row arguments (after the model's): " + "; ".join(
        f"{row['label']}: {' '.join(row['args'])}" for row in summary["rows"])]
    problems = summary["loss_check"]
    lines += ["", "Loss check (every row vs the stock row with its attention; SDPA vs "
              "Megatron attention within the cross-kernel tolerance): "
              + ("PASS" if not problems else "FAIL")] + [f"  {p}" for p in problems]
    traced = [row for row in summary["rows"] if row["kernels"]]
    if traced:
        lines += kernel_table(traced)
    return "\n".join(lines)


def kernel_table(rows: list) -> list:
    """One traced step per row (`--trace`): device activity and host synchronisation
    (`dhelix.bench.gpu_kernels`), then each row's largest kernels."""
    lines = ["", "One traced step per row (torch.profiler; ms):", "",
             "| row | kernels | kernel ms | copy ms | GPU busy | span | idle in span | "
             "streams | host syncs (ms) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    for row in rows:
        k = row["kernels"]
        lines.append(f"| {row['label']} | {k['kernels']} | {k['kernel_ms']:.1f} | "
                     f"{k['copy_ms']:.1f} | {k['busy_ms']:.1f} | {k['span_ms']:.1f} | "
                     f"{k['span_ms'] - k['busy_ms']:.1f} | {k['streams']} | "
                     f"{k['host_syncs']} ({k['host_sync_ms']:.1f}) |")
    for row in (r for r in rows if r["kernels"]["top"]):
        lines.append(f"\nLargest kernels, {row['label']}: " + "; ".join(
            f"{name[:60]} x{count} {ms:.1f}" for name, count, ms in row["kernels"]["top"]))
    return lines


def main(argv=None) -> int:
    from dhelix.options import ATTENTION_CHOICES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=None,
                        help="measured repetitions per row (default 10; 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured rounds first (default 2; 1 with --quick)")
    parser.add_argument("--dhelix-rows-attention", choices=ATTENTION_CHOICES, default="sdpa",
                        help="core attention of the two --dhelix rows (default sdpa; the "
                             "stock rows are one of each)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny 2-layer model (CPU smoke test; wall-clock timing there)")
    parser.add_argument("--dhelix-profile", default=None,
                        help="profile the dp row plans from (`dhelix profile` of this model "
                             "on this GPU; default: analytic costs)")
    parser.add_argument("--dataloader-mask", action="store_true",
                        help="let the data loader build Megatron's [b, 1, s, s] attention "
                             "mask for every row (Megatron's default; by default no row "
                             "builds it: none reads it)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="after the measured rounds, trace one step of every row with "
                             "torch.profiler: DIR/ROW.trace.json.gz and a table of kernels, "
                             "GPU busy time and host synchronisation")
    parser.add_argument("--json", default=None, help="also write the summary here")
    parser.add_argument("--timeout", type=int, default=1800,
                        help="seconds before the benchmark's process is stopped")
    parser.add_argument("model_args", nargs=argparse.REMAINDER,
                        help="after --: Megatron model arguments replacing the default model")
    ns = parser.parse_args(argv)
    model = ns.model_args[1:] if ns.model_args[:1] == ["--"] else ns.model_args
    model = model or (QUICK_MODEL if ns.quick else DEFAULT_MODEL)
    reps = ns.reps if ns.reps is not None else (2 if ns.quick else 10)
    warmup = ns.warmup if ns.warmup is not None else (1 if ns.quick else 2)
    if reps < 1 or warmup < 0:
        print("error: --reps must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    rows = rows_for(ns.dhelix_rows_attention, ns.dhelix_profile, ns.dataloader_mask)
    from dhelix.bench.systems import RUN_ARGS, ArgumentsRefused, parse_megatron_args
    from dhelix.harness import run_on_ranks

    try:
        for row in rows:
            parse_megatron_args([*RUN_ARGS, *model, *row.args], 1)
    except ArgumentsRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = run_on_ranks(bench_body, 1, model, rows, reps, warmup, ns.trace,
                           timeout_s=ns.timeout)
    summary = summarise(rows, results)
    print(table(summary, model, reps, warmup))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"megatron_args": model, "reps": reps,
                                             "warmup": warmup, **summary}, indent=1))
    return 1 if summary["loss_check"] else 0


if __name__ == "__main__":
    sys.exit(main())
