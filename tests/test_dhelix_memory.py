"""Peak memory of one --dhelix forward/backward stays within Megatron's schedule's peak
x 1.10 plus the tied word-embedding gradient the output layer's backward hands over to the
embedding's (`megatron_patches.tied_embedding`: one vocab/TP x hidden fp32 tensor held per
micro-batch) (tensor storage allocated by the compute thread, dhelix.memtrace), on the tiny
model with TP=2 + SP and 4 micro-batches; the plan was made under the DP's memory bound
(`planner.memory`), which keeps each layer pair's forward allocations behind its backward's
frees, so what DHelix holds beyond Megatron is outside the layers: that gradient (the
embedding output, the loss part's input and a chunk's input are freed after their last
reader, `docs/runtime.md`). (Before the bound: Megatron x 1.03 + one layer's activations +
the tied gradient.)

Why 1.10 and not the 1.05 the benchmark model meets on average: over five runs (ten rank
readings) DHelix read 6.73-7.04 MiB and Megatron 6.36-6.99 MiB (single readings
0.965x-1.095x of the same rank's Megatron). Megatron's own reading moves by up to 0.6 MiB
(10% at this size) between runs and ranks although both ranks hold tensors of the same sizes
(TP shards), so each rank's DHelix reading is compared with the larger of the ranks'
Megatron readings, and 1.05 would fail on noise. Both systems are
`megatron.training.pretrain` set-ups in the benchmark's process (the step harness), share
Megatron's groups and start from the same weights and data: their first steps' losses agree."""

import pytest

from dhelix.bench.systems import tiny_model
from dhelix.harness import run_on_ranks
from scripts.bench_dhelix_pp1 import bench_body

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier


TP = 2


def test_dhelix_peak_memory_within_bound():
    model = tiny_model()
    hidden = int(model[model.index("--hidden-size") + 1])
    args = [*model, "--tensor-model-parallel-size", str(TP), "--sequence-parallel",
            "--seq-length", "128", "--max-position-embeddings", "128"]
    results = run_on_ranks(bench_body, 2, args, 1, 0, timeout_s=480,
                           env={"OMP_NUM_THREADS": "1"})
    megatron = max(r["memory"]["megatron"] for r in results)  # see the module docstring
    for r in results:
        # Megatron's padded vocabulary, split over TP, x hidden, fp32
        tied_gradient_bytes = r["padded_vocab_size"] // TP * hidden * 4
        dhelix = r["memory"]["dhelix"]
        bound = megatron * 1.10 + tied_gradient_bytes
        print(f"rank {r['rank']}: megatron {r['memory']['megatron'] / 2**20:.2f} MiB (larger "
              f"of the ranks {megatron / 2**20:.2f}), dhelix "
              f"{dhelix / 2**20:.2f} MiB ({dhelix / megatron:.3f}x), bound "
              f"{bound / 2**20:.2f} MiB; plan: {r['plan_source']}")
        assert megatron > 0 and r["layer_activation_bytes"] > 0
        assert "memory bound" in r["plan_source"]  # the DP planned under the bound
        assert dhelix <= bound
        losses = r["first_loss"]
        assert losses["megatron"] == pytest.approx(losses["dhelix"], rel=1e-6, abs=1e-6)
        # Megatron's communication alone: with SP every layer gathers and reduce-scatters
        # twice in its forward and again in its backward, on every micro-batch
        floor = r["link_floor"]
        assert floor["collectives"] >= 8 * 2 * 2, floor  # layers x micro-batches
        assert all(0 < t < 60 for t in floor["one_at_a_time_s"] + floor["all_at_once_s"])
