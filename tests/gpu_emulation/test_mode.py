"""`GpuEmulationMode` on real megatron-core code and real gloo ranks (one launch, 2 ranks):

- a megatron-core GPT layer (local spec, RMSNorm, SwiGLU, GQA, no bias; small shapes, CPU)
  runs forward and backward under the mode with correct output and gradient shapes; its
  wall time follows the model (modelled x S <= wall <= modelled x S + 1.5 s of host time)
  while the process's CPU time stays below a quarter of the modelled time (no core held);
- the stream is drained before a collective is issued: rank 0 charges 0.6 s of kernels and
  then all-reduces; rank 1, whose stream is empty, waits for it in that all-reduce;
- stream-ordered issue: an async all-reduce issued while 0.6 s of kernels are queued returns
  at once and its bytes move when the stream reaches it; with the option off the host
  sleeps until the stream drained, and so does it under a dispatch mode entered before the
  emulation (the link floor's recorder sees the collective);
- kernels charged while an async collective is in flight cost (1 + overlap_slowdown) x, and
  no more once it completed.
Plus single-process checks of the dispatch rules (fake outputs, in-place skip, real small ops).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dhelix.gpu_emulation.mode import TermTotal
from dhelix.harness import run_megatron_ranks

H100_PROFILE = Path("/work/shared/measurements/h100_llama8b_layer_comp_only_profile.json")
SCALE = 5000.0
pytestmark = pytest.mark.skipif(not H100_PROFILE.exists(), reason="needs the shared H100 profile")


def _mode(scale=SCALE, slowdown=0.25, stream_ordered=True):
    from dhelix.gpu_emulation.kernel_model import fit_kernel_model
    from dhelix.gpu_emulation.mode import EmulationConfig, GpuEmulationMode
    from profiler.profile_file import load_profile

    model = fit_kernel_model(load_profile(H100_PROFILE))
    return GpuEmulationMode(model, EmulationConfig(time_scale=scale, overlap_slowdown=slowdown,
                                                   stream_ordered_collectives=stream_ordered))


def _gpt_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    config = TransformerConfig(
        num_layers=1, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8,
        num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    return build_module(get_gpt_layer_local_spec(normalization="RMSNorm"), config=config,
                        layer_number=1)


def _layer_and_collectives(ctx):
    import time

    import torch.distributed as dist

    out = {}
    layer = _gpt_layer()
    x = torch.randn(256, 2, 512, requires_grad=True)
    mode = _mode()
    with mode:  # warm-up pass: first-call costs of torch and Megatron are host time
        y, _ = layer(x)
        y.sum().backward()
    layer.zero_grad(set_to_none=True)
    x.grad = None
    mode = _mode()
    wall, cpu = time.perf_counter(), time.process_time()
    with mode:
        y, _ = layer(x)
        y.sum().backward()
    out["wall_s"], out["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
    report = mode.report()
    out["modelled_s"] = report.modelled_ms * SCALE / 1000
    out["terms"] = {k: v.count for k, v in report.by_term.items()}
    out["shapes"] = (tuple(y.shape), tuple(x.grad.shape))
    out["grads"] = {n: (tuple(p.shape), None if p.grad is None else tuple(p.grad.shape))
                    for n, p in layer.named_parameters()}

    # flush before a collective: rank 0 owes 0.6 s of kernels when it all-reduces
    dist.barrier()
    big = torch.empty(4096, 4096, dtype=torch.bfloat16)
    mode = _mode(scale=1.0)
    n_mm = 0
    with mode:
        if ctx.rank == 0:
            while mode.report().modelled_ms < 600:
                big @ big
                n_mm += 1
        start = time.perf_counter()
        dist.all_reduce(torch.ones(8))
        out["allreduce_s"] = time.perf_counter() - start
        out["issue_modelled_ms"] = mode.report().modelled_ms

    # stream-ordered issue: rank 0 owes 0.6 s of kernels when it issues an async all-reduce;
    # the host gets the handle at once and the bytes move when the stream reaches it (with
    # the option off the host sleeps until the stream drained). Time scale 20: a GEMM then
    # takes 5.6 ms on the emulated stream, well above the host's 0.2-0.5 ms to dispatch it,
    # so the stream runs ahead of the host (at scale 1 a slow host never gets 0.6 s ahead)
    for ordered in (True, False):
        dist.barrier()
        mode = _mode(scale=20.0, stream_ordered=ordered)
        with mode:
            if ctx.rank == 0:  # owe 0.6 s however slowly this host dispatches
                while mode._stream_end - time.perf_counter() < 0.6:
                    big @ big
            start = time.perf_counter()
            owed = max(0.0, mode._stream_end - start)  # the stream's kernels still to run
            work = dist.all_reduce(torch.ones(8), async_op=True)
            issued = time.perf_counter() - start
            work.wait()
            out[f"ordered_{ordered}"] = (issued, time.perf_counter() - start,
                                         mode.report().stream_ordered, owed)

    # under a dispatch mode entered before the emulation (the link floor's recorder) the
    # collective is issued on this thread, so that mode sees it
    from dhelix.bench.link_floor import record_collectives

    def owed_then_all_reduce():
        mode = _mode(scale=1.0)
        with mode:
            while mode.report().modelled_ms < 100:
                big @ big
            dist.all_reduce(torch.ones(8), async_op=True).wait()
        return mode.report().stream_ordered

    dist.barrier()
    ordered, recorded, _ = record_collectives(owed_then_all_reduce)
    out["under_recorder"] = (ordered, len(recorded))

    # a pending isend (its receiver 0.3 s late) does not slow rank 0's kernel
    dist.barrier()
    mode = _mode(scale=1.0)
    with mode:
        if ctx.rank == 0:
            send = dist.isend(torch.ones(8), dst=1)
            big @ big
            send.wait()
        else:
            time.sleep(0.3)
            dist.recv(torch.empty(8), src=0)
    gemm = mode.report().by_term.get("gemm.dgrad", TermTotal(0, 0.0, 0))
    out["p2p_slowed"] = (gemm.count, gemm.slowed)

    # one collective of a process group at a time (NCCL's one stream per communicator):
    # rank 1 joins 0.4 s late, so rank 0's first all-reduce is still running when it issues
    # a second on the same group, which then waits in the issuer for the first to end;
    # drain() (a host read, a timer's mark) waits for the stream only, synchronize() also
    # for the second to be issued
    from torch.distributed.distributed_c10d import _get_default_group

    dist.barrier()
    if ctx.rank == 1:
        time.sleep(0.4)
    mode = _mode(scale=1.0)
    with mode:
        first = dist.all_reduce(torch.ones(8), async_op=True)
        busy = mode._issuer.busy(_get_default_group())
        second = dist.all_reduce(torch.ones(8), async_op=True)
        deferred = mode.report().stream_ordered
        started = time.perf_counter()
        mode.drain()
        drained_at_once = time.perf_counter() - started < 0.2 and not first.is_completed()
        mode.synchronize()
        synchronized_after_first = first.is_completed()
        second.wait()
        first_done = first.is_completed()
    out["group_fifo"] = (busy, deferred, first_done, drained_at_once, synchronized_after_first)

    # slowdown while an async collective is in flight (rank 0 joins it 0.5 s late)
    dist.barrier()
    if ctx.rank == 0:
        time.sleep(0.5)
    mode = _mode(scale=1.0, slowdown=0.25)
    one = mode.model.gemm_ms(4096, 4096, 4096, phase="dgrad")
    with mode:
        work = dist.all_reduce(torch.ones(8), async_op=True)
        if ctx.rank == 1:
            big @ big  # in flight: rank 0 has not joined
        work.wait()
        big @ big      # completed
    report = mode.report()
    out["slowdown"] = (report.by_term["gemm.dgrad"].modelled_ms, one,
                       report.by_term["gemm.dgrad"].slowed, report.collectives)
    return out


@pytest.mark.slow  # 2 gloo ranks, ~16 s
def test_gpt_layer_and_collectives_under_the_mode():
    results = run_megatron_ranks(_layer_and_collectives, 2, timeout_s=240,
                                 env={"OMP_NUM_THREADS": "1"})
    print({k: v for k, v in results[0].items() if k != "grads"})
    print({k: v for k, v in results[1].items() if k != "grads"})
    for rank, r in enumerate(results):
        assert r["shapes"] == ((256, 2, 512), (256, 2, 512))
        for name, (shape, grad) in r["grads"].items():
            assert grad == shape, name
        # torch's RMSNorm reaches the dispatcher as element-wise kernels on CPU (no memory.norm)
        assert {"gemm.fwd", "gemm.dgrad", "gemm.wgrad", "gemm.batched",
                "memory.elementwise"} <= set(r["terms"]), r["terms"]
        assert 2.0 < r["modelled_s"], r  # the check below is not dominated by host time
        assert r["modelled_s"] * 0.99 <= r["wall_s"] <= r["modelled_s"] + 1.5, r
        assert r["cpu_s"] < 0.25 * r["modelled_s"], r
    assert results[0]["issue_modelled_ms"] >= 600 and results[1]["issue_modelled_ms"] == 0
    assert results[1]["allreduce_s"] >= 0.55, results[1]["allreduce_s"]
    issued, done, ordered, owed = results[0]["ordered_True"]
    assert owed > 0.3 and issued < 0.1 and done >= owed and ordered == 1, results[0]
    issued, done, ordered, owed = results[0]["ordered_False"]
    assert owed > 0.3 and issued >= owed and ordered == 0, results[0]["ordered_False"]
    for key in ("ordered_True", "ordered_False"):  # rank 1's stream is empty: issued at once
        issued, done, ordered, owed = results[1][key]
        assert issued < 0.1 and done >= results[0][key][3] - 0.1 and ordered == 0 == owed, (
            key, results[1][key])
    assert results[0]["under_recorder"] == (0, 1), results[0]["under_recorder"]
    assert results[0]["p2p_slowed"] == (1, 0), results[0]["p2p_slowed"]
    assert results[0]["group_fifo"] == (True, 1, True, True, True), results[0]["group_fifo"]
    ms0, one0, slowed0, n0 = results[0]["slowdown"]
    ms1, one1, slowed1, n1 = results[1]["slowdown"]
    assert (slowed0, n0) == (0, 1) and ms0 == pytest.approx(one0)
    assert (slowed1, n1) == (1, 1) and ms1 == pytest.approx(one1 * 2.25)


def test_dispatch_rules_in_one_process():
    mode = _mode(scale=1.0)
    a = torch.randn(256, 128)
    w = torch.randn(64, 128)
    small = torch.arange(6.0)
    before = w.clone()
    with mode:
        y = a @ w.t()                 # compute: fake output of the right layout
        w.add_(1.0)                   # in-place compute: skipped, charged
        s = (small * 2).sum().item()  # cheap: real
        v = a.view(128, 256)          # view: real
        f = a.to(device="cpu", dtype=torch.float64)  # _to_copy naming its device: faked
        z = torch.zeros(256, 128)     # a filling factory above cheap_numel: faked, charged
        z_small = torch.zeros(6)      # at most cheap_numel: real zeros
        rng = torch.get_rng_state().clone()  # a byte state (5056 elements): cloned for real
    assert y.shape == (256, 64) and y.dtype == a.dtype and y.device == a.device
    assert f.dtype == torch.float64 and f.shape == a.shape and f.device == a.device
    assert z.shape == (256, 128) and torch.equal(z_small, torch.zeros(6))
    assert mode.report().ran_for_real == 0
    torch.set_rng_state(rng)  # a faked clone would be garbage: "Invalid mt19937 state"
    assert mode.report().by_op["zeros"].count == 1 and mode.report().by_op["zeros"].nbytes == z.nbytes
    assert torch.equal(w, before) and w._version == 1
    assert s == 30.0 and v.data_ptr() == a.data_ptr()
    terms = mode.report().by_term
    assert terms["gemm.fwd"].count == 1 and "view" not in mode.report().by_op
    assert mode.report().by_op["add_"].count == 1
    from dhelix.gpu_emulation.mode import EmulationConfig
    with pytest.raises(ValueError, match="error: time_scale"):
        EmulationConfig(time_scale=0)


def test_index_data_and_real_scopes_run_for_real():
    mode = _mode(scale=1.0)
    routing = torch.rand(8192, 4) > 0.5   # 32768 bools: above cheap_numel
    a = torch.randn(256, 128)
    w = torch.randn(64, 128)
    with mode:
        counts = routing.sum(dim=0)        # index data only: real
        order = torch.argsort(routing.view(-1).int(), stable=True)  # real
        scaled = a * 2.0                   # float above cheap_numel: faked
        mode.enter_real()
        real_scaled = a * 2.0              # inside the real scope: real
        y = a @ w.t()                      # a GEMM stays faked there
        mode.exit_real()
        with pytest.raises(RuntimeError, match=r"error: exit_real\(\) without enter_real"):
            mode.exit_real()
    assert torch.equal(counts, routing.sum(dim=0))
    assert torch.equal(order, torch.argsort(routing.view(-1).int(), stable=True))
    assert torch.equal(real_scaled, a * 2.0) and scaled.shape == a.shape
    assert y.shape == (256, 64)
    ops = mode.report().by_op
    # real or faked, every kernel is charged
    assert ops["sum"].count == 1 and ops["mul"].count == 2 and ops["mm"].count == 1


def _router_under_the_mode(ctx):
    """A megatron-core TopKRouter (hidden 256, 4096 tokens, top-2 of 4 experts: its logits
    and routing map are above cheap_numel) under the mode, with and without
    `routing_regions`."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    from dhelix.gpu_emulation.emulated_run import emulated_call
    from dhelix.gpu_emulation.kernel_model import fit_kernel_model
    from dhelix.gpu_emulation.mode import EmulationConfig
    from profiler.profile_file import load_profile

    config = TransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=4,
        moe_router_topk=2, moe_aux_loss_coeff=0.0, use_cpu_initialization=True,
        moe_router_load_balancing_type="none")
    router = TopKRouter(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "cp", "tp_cp", "tp_dp_cp"]))
    hidden = torch.randn(2048, 2, 256)
    model = fit_kernel_model(load_profile(H100_PROFILE))
    with emulated_call(router, model, EmulationConfig(time_scale=1.0)) as mode:
        probs, routing_map = router(hidden)
    report = mode.report()
    return {"map_shape": tuple(routing_map.shape), "per_token": routing_map.sum(dim=1).tolist(),
            "counts": routing_map.sum(dim=0).tolist(), "probs_shape": tuple(probs.shape),
            "gemm": sum(t.count for k, t in report.by_term.items() if k.startswith("gemm")),
            "force_after": config.moe_router_force_load_balancing}


def test_moe_router_routes_for_real_under_the_emulation():
    r = run_megatron_ranks(_router_under_the_mode, 1, timeout_s=240,
                           env={"OMP_NUM_THREADS": "1"})[0]
    assert r["map_shape"] == (4096, 4) and r["probs_shape"] == (4096, 4)
    assert set(r["per_token"]) == {2}, "every token routed to exactly top-2 experts"
    assert sum(r["counts"]) == 8192 and min(r["counts"]) > 1500, r["counts"]  # random logits
    assert r["gemm"] >= 1  # the gating GEMM charged, not computed
    assert r["force_after"] is False  # Megatron's option restored after the call


def test_region_charges_once_and_absorbs_its_kernels():
    mode = _mode(scale=1.0)
    a = torch.randn(256, 128)
    with mode:
        mode.enter_region("attention.unfused.fwd", 7.5)
        with pytest.raises(RuntimeError, match="error: region .* entered inside region"):
            mode.enter_region("attention.unfused.bwd", 1.0)
        y = a @ a.t()          # absorbed: faked, charged nothing
        z = (y * 2.0).exp()    # absorbed
        mode.exit_region()
        with pytest.raises(RuntimeError, match=r"error: exit_region\(\) without enter_region"):
            mode.exit_region()
        a @ a.t()              # charged again
    report = mode.report()
    assert z.shape == (256, 256) and report.absorbed == 3
    assert report.by_term["attention.unfused.fwd"] == TermTotal(1, 7.5, 0, 0.0)
    assert report.by_term["gemm.fwd"].count == 1 and "exp" not in report.by_op
    assert report.modelled_ms == pytest.approx(7.5 + report.by_term["gemm.fwd"].modelled_ms)


def test_memory_kernels_report_their_bytes():
    mode = _mode(scale=1.0)
    a = torch.randn(512, 512)  # 1 MiB of fp32
    with mode:
        a + a
        a.to(torch.bfloat16)
    ops = mode.report().by_op
    assert ops["add"].nbytes == 3 * a.numel() * 4
    assert ops["_to_copy"].nbytes == a.numel() * (4 + 2)
    assert mode.report().by_term["memory.elementwise"].nbytes == ops["add"].nbytes + \
        ops["_to_copy"].nbytes


def test_timer_region_excludes_kernels_issued_before_it():
    """`profiler.timing.Timer` on an emulated GPU: kernels queued before a region (the
    untimed operators that advance a profiling pass) end before its clock starts, as
    `torch.cuda.synchronize` makes them on CUDA; the region's own kernels are in it."""
    from profiler.timing import Timer

    mode = _mode(scale=1.0)
    a = torch.randn(256, 128)
    with mode:
        mode.enter_region("attention.unfused.bwd", 400.0)  # 0.4 s queued, host runs ahead
        mode.exit_region()
        timer = Timer(cuda=False, synchronize=mode.synchronize)
        timer.time(lambda: a @ a.t())
        mode.enter_region("attention.unfused.fwd", 200.0)
        mode.exit_region()
        timer.time(lambda: (mode.enter_region("attention.unfused.fwd", 150.0),
                            mode.exit_region()))
        first, second = timer.collect()
    assert first < 100.0, f"the region waited for the 400 ms queued before it: {first:.0f} ms"
    assert 150.0 <= second < 250.0, f"the region's own 150 ms kernel: {second:.0f} ms"


def test_stream_idle_counts_only_gaps_between_kernels():
    import time

    mode = _mode(scale=1.0)
    a = torch.empty(2048, 2048)
    with mode:
        time.sleep(0.05)          # before the first kernel: not a gap
        a @ a
        kernel_s = mode.report().modelled_ms / 1000
        time.sleep(0.2)           # the host busy: the stream drains and sits empty
        a @ a
        a @ a                     # issued while the stream is busy: no gap
    assert kernel_s < 0.05
    idle = mode.report().stream_idle_s
    assert 0.2 - kernel_s <= idle <= 0.2 - kernel_s + 0.05, (idle, kernel_s)
    gaps = mode.idle_gaps()  # where they were, in order; the host's sleep the longest
    assert sum(end - start for start, end in gaps) == pytest.approx(idle)
    assert all(start < end <= time.perf_counter() for start, end in gaps)
    longest = max(gaps, key=lambda gap: gap[1] - gap[0])
    assert 0.2 - kernel_s <= longest[1] - longest[0] <= idle


def test_stream_time_is_when_the_queued_kernels_end():
    import time

    mode = _mode(scale=50.0)
    a = torch.empty(2048, 2048)
    with mode:
        before = time.perf_counter()
        assert before <= mode.stream_time() <= time.perf_counter()  # nothing queued: now
        a @ a
        a @ a
        queued = mode.report().modelled_ms * 50.0 / 1000  # the host did not wait for them
        ahead = mode.stream_time() - time.perf_counter()
        assert 0.5 * queued < ahead <= queued, (ahead, queued)
        mode.drain()
        assert mode.stream_time() - time.perf_counter() < 1e-3


class _RaisingCollective:
    """A stand-in operator for the issuer's error path only (a refused collective)."""

    class _schema:  # noqa: N801 - mirrors an OpOverload's attribute
        returns = ("tensors", "work")

    def __call__(self, *args, **kwargs):
        raise RuntimeError("refused by the transport")


def test_stream_ordered_issue_raises_a_collectives_error():
    import time

    from dhelix.gpu_emulation.stream_ordered_issue import StreamOrderedIssuer
    from torch._C._distributed_c10d import Work

    issuer = StreamOrderedIssuer()
    _, boxed = issuer.submit(time.perf_counter() + 0.05, _RaisingCollective(), ([],), {})
    work = Work.unbox(boxed)
    assert not work.is_completed()
    with pytest.raises(RuntimeError, match="refused by the transport"):
        work.wait()
    issuer.close()  # the error was seen by wait(): close does not raise it again
    issuer = StreamOrderedIssuer()
    issuer.submit(time.perf_counter(), _RaisingCollective(), ([],), {})
    with pytest.raises(RuntimeError, match="refused by the transport"):
        issuer.close()  # nobody waited: close raises it


def test_point_to_point_operators_do_not_count_as_collectives_in_flight():
    from dhelix.gpu_emulation.aten_costs import op_name
    from dhelix.gpu_emulation.mode import POINT_TO_POINT

    # the c10d operators a pipeline's isend / recv dispatch to
    assert {op_name(torch.ops.c10d.send.default),
            op_name(torch.ops.c10d.recv_.default)} <= POINT_TO_POINT
    assert "allreduce_" not in POINT_TO_POINT


def test_sdpa_core_attention_is_charged_as_the_fused_kernel_under_the_mode():
    """`SDPAttention` runs torch's math kernel on CPU (parity with Megatron's attention),
    but under the mode the CPU stands in for a GPU: the fused kernel is dispatched and
    charged (`attention.sdpa`), and no [b, heads, s, s] probabilities are materialised."""
    from torch.profiler import profile

    from dhelix.devices import gpu_emulated
    from tests.test_sdpa_attention import _pair

    _, sdpa = _pair(heads=4, groups=2, tp=1, dtype=torch.float32, sequence_parallel=False)
    q = torch.randn(64, 2, 4, 16)
    k, v = torch.randn(64, 2, 2, 16), torch.randn(64, 2, 2, 16)
    assert not gpu_emulated()
    with profile() as outside:
        sdpa(q, k, v, None)
    mode = _mode(scale=1.0)
    with mode:
        assert gpu_emulated()
        sdpa(q, k, v, None)
    assert not gpu_emulated()
    names = {e.name for e in outside.events()}
    assert "aten::_scaled_dot_product_attention_math" in names, names
    assert mode.report().by_term["attention.sdpa.fwd"].count == 1
    charged = mode.report().by_op
    assert any("flash_attention" in op for op in charged), charged
    assert not any("softmax" in op or "bmm" in op or "math" in op for op in charged), charged
