"""The emulated GPU's all-to-all exchange (`dhelix.gpu_emulation.all_to_all_exchange`) on 2
real gloo ranks with two gloo devices each (one launch):

- its output equals c10d's `all_to_all_single` for uneven splits (bf16 rows), equal splits
  (empty split lists, fp32 vectors) and a split of zero rows;
- its handle: `wait()` from two threads at once returns in both (gloo's own point-to-point
  Works hang on a second wait), `is_completed()` and the future are set once it completed;
- `stand_in` keeps c10d's operator for another collective, a non-contiguous tensor and a
  single gloo device;
- under `GpuEmulationMode` an asynchronous `all_to_all_single` (stream-ordered, issued while
  kernels are queued) delivers the same rows as without the mode, and so do synchronous
  tiny ones issued on the host's thread (complete before c10d unboxes their handles); a
  dispatch mode entered before the emulation (the link floor's recorder) still records
  c10d's `alltoall_base_`;
- the link floor's replay of a recorded all-to-all returns.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dhelix.harness import run_on_ranks

H100_PROFILE = Path("/work/shared/measurements/h100_llama8b_layer_comp_only_profile.json")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not H100_PROFILE.exists(), reason="needs the shared H100 profile")]

# rank r sends SPLITS[r][p] rows to rank p
SPLITS = [[3, 5], [2, 6]]


def _exchanges(ctx):
    import threading

    import torch
    import torch.distributed as dist

    from dhelix.bench.link_floor import record_collectives, replay
    from dhelix.gpu_emulation.all_to_all_exchange import AllToAllExchanges, gloo_devices
    from dhelix.gpu_emulation.kernel_model import fit_kernel_model
    from dhelix.gpu_emulation.mode import EmulationConfig, GpuEmulationMode
    from profiler.profile_file import load_profile

    dist.init_process_group("gloo")
    cpu = torch.device("cpu")  # gloo's collectives and point-to-point run on CPU tensors
    me, out = ctx.rank, {}
    send = SPLITS[me]
    receive = [SPLITS[p][me] for p in range(2)]
    rows = torch.arange(sum(send) * 4, dtype=torch.bfloat16, device=cpu).reshape(-1, 4) + 100 * me

    def received_rows():
        return torch.empty(sum(receive), 4, dtype=torch.bfloat16, device=cpu)

    def reference(output, tensor, out_splits, in_splits):
        dist.all_to_all_single(output, tensor, out_splits, in_splits)
        return output

    exchanges = AllToAllExchanges()
    out["devices"] = (gloo_devices(), exchanges.devices)
    a2a = torch.ops.c10d.alltoall_base_.default
    group = dist.group.WORLD

    def exchanged(output, tensor, out_splits, in_splits):
        work = exchanges.exchange(output, tensor, group, out_splits, in_splits)
        work.wait()
        return output

    want = reference(received_rows(), rows, receive, send)
    got = exchanged(received_rows(), rows, receive, send)
    out["uneven"] = torch.equal(want, got)
    vector = torch.arange(6, dtype=torch.float32, device=cpu) + 10 * me
    out["equal"] = torch.equal(reference(torch.empty(6, device=cpu), vector, [], []),
                               exchanged(torch.empty(6, device=cpu), vector, [], []))
    zero_send = [4, 0] if me == 0 else [0, 4]
    four = torch.ones(4, 2, device=cpu) * (me + 1)
    zero_rows = exchanged(torch.empty(4, 2, device=cpu), four, zero_send, zero_send)
    out["zero_rows"] = torch.equal(zero_rows, four)

    # the handle: two waiters at once, completion, future
    work = exchanges.exchange(received_rows(), rows, group,
                              receive, send)
    waited = []
    thread = threading.Thread(target=lambda: waited.append(work.wait()))
    thread.start()
    waited.append(work.wait())
    thread.join(timeout=30)
    out["two_waiters"] = (waited, thread.is_alive(), work.is_completed(),
                          work.get_future().done())

    # stand-ins
    ar = torch.ops.c10d.allreduce_.default
    strided = torch.empty(8, 8, device=cpu)[:, :4]
    out["stand_in"] = (
        exchanges.stand_in(a2a, (rows, rows, group.boxed(), [], [])) is not a2a,
        exchanges.stand_in(ar, ([rows], group.boxed())) is ar,
        exchanges.stand_in(a2a, (strided, strided, group.boxed(), [], [])) is a2a,
        AllToAllExchanges(devices=1).stand_in(a2a, (rows, rows, group.boxed(), [], [])) is a2a)
    exchanges.close()

    # under the emulation: stream-ordered, while 0.2 s of kernels are queued
    model = fit_kernel_model(load_profile(H100_PROFILE))
    big = torch.randn(64, 64, device=cpu)
    with GpuEmulationMode(model, EmulationConfig(time_scale=2000.0)) as mode:
        for _ in range(3):
            big @ big  # queued kernels (faked outputs)
        output = received_rows()
        handle = dist.all_to_all_single(output, rows, receive, send, async_op=True)
        handle.wait()
        deferred = mode.report().stream_ordered
        mode.synchronize()
        # issued on the host's thread (the stream drained), tiny: complete before c10d
        # unboxes the handle; waited by c10d's synchronous call
        small = [torch.empty(2, device=cpu) for _ in range(20)]
        for tensor in small:
            dist.all_to_all_single(tensor, torch.full((2,), float(me), device=cpu))
    out["emulated"] = (torch.equal(output, want), deferred,
                       all(t.tolist() == [0.0, 1.0] for t in small))

    def recorded_step():
        with GpuEmulationMode(model, EmulationConfig(time_scale=2000.0)):
            dist.all_to_all_single(received_rows(), rows,
                                   receive, send)

    _, collectives, _ = record_collectives(recorded_step)
    out["recorded"] = [str(c.op).split(".")[1] for c in collectives]
    out["replay_s"] = [replay(collectives, all_at_once=flag) for flag in (False, True)]
    dist.barrier()
    return out


def test_exchange_matches_all_to_all_and_runs_under_the_emulation():
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo,lo"}
    for r in run_on_ranks(_exchanges, 2, timeout_s=180, env=env):
        assert r["devices"] == (2, 2)
        assert r["uneven"] and r["equal"] and r["zero_rows"]
        assert r["two_waiters"] == ([True, True], False, True, True)
        assert r["stand_in"] == (True, True, True, True)
        assert r["emulated"] == (True, 1, True)
        assert r["recorded"] == ["alltoall_base_"]
        assert all(0 < t < 30 for t in r["replay_s"]), r["replay_s"]
