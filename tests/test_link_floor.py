"""The link-floor recorder and replay (`dhelix.bench.link_floor`) on 2 real gloo ranks: every
collective of the recorded code is noted with its group and tensor sizes (synchronous and
asynchronous, on two groups), send/recv and barriers are not, and a replay issues them again
on the same groups, one at a time and all at once, and returns, holding one flat buffer per
tensor position of a call rather than one per call or per shape."""

from __future__ import annotations

import pytest

from dhelix.harness import run_on_ranks


def test_replay_buffers_hold_the_largest_tensor_of_each_position_once():
    """Calls whose shapes differ (an MoE all-to-all's rows follow the routing) share one
    zero-filled flat buffer per (dtype, device) position, sized by the largest tensor
    recorded there; every call gets views of its recorded shapes."""
    import torch

    from dhelix.bench.link_floor import RecordedCollective, ReplayBuffers, _spec

    def call(*tensors):
        spec, nbytes = _spec(tuple(tensors))
        return RecordedCollective("op", (spec, [1, 2]), (), nbytes)

    f32, bf16 = torch.float32, torch.bfloat16
    calls = [call(torch.empty(rows, 8, dtype=bf16), torch.empty(rows + 1, 8, dtype=bf16),
                  torch.empty(3, dtype=f32)) for rows in (5, 9, 2)]
    buffers = ReplayBuffers()
    buffers.reserve(calls)
    # bf16 position 0: 9 x 8, position 1: 10 x 8; f32 position 0: 3
    assert buffers.nbytes() == (9 * 8 + 10 * 8) * 2 + 3 * 4
    for rows, c in zip((5, 9, 2), calls):
        (out, inp, small), splits = buffers.arguments(c)[0]
        assert out.shape == (rows, 8) and inp.shape == (rows + 1, 8) and small.shape == (3,)
        assert out.dtype == bf16 and small.dtype == f32 and splits == [1, 2]
        assert out.data_ptr() != inp.data_ptr() and not out.any() and not inp.any()
    assert buffers.nbytes() == (9 * 8 + 10 * 8) * 2 + 3 * 4  # views: nothing new held


def _record_and_replay(ctx):
    import torch
    import torch.distributed as dist

    from dhelix.bench.link_floor import ReplayBuffers, record_collectives, replay

    dist.init_process_group("gloo")  # the harness's RANK, WORLD_SIZE, MASTER_ADDR/PORT
    other = dist.new_group([0, 1])
    x = torch.full((1024,), float(ctx.rank + 1))

    def step():
        dist.all_reduce(x)                                    # 4 KiB
        dist.all_reduce(x)                                    # the same spec again
        work = dist.all_reduce(torch.ones(256), group=other, async_op=True)
        gathered = torch.empty(2048)
        dist.all_gather_into_tensor(gathered, x)              # 4 KiB in, 8 KiB out
        dist.reduce_scatter_tensor(torch.empty(512), torch.ones(1024), group=other)
        dist.barrier()
        if ctx.rank == 0:
            dist.send(torch.ones(8), 1)
        else:
            dist.recv(torch.empty(8), 0)
        work.wait()
        return float(x[0])

    total, collectives, skipped = record_collectives(step)
    names = [str(c.op).split(".")[1] for c in collectives]
    buffers = ReplayBuffers()
    times = [replay(collectives, all_at_once=flag, buffers=buffers)
             for flag in (False, True, False)]
    dist.barrier()
    return {"total": total, "names": names, "bytes": [c.tensor_bytes for c in collectives],
            "skipped": skipped, "times": times, "x_after": float(x[0]),
            "buffer_bytes": buffers.nbytes()}


@pytest.mark.slow  # multi-process: not in the fast tier
def test_record_and_replay_collectives():
    for r in run_on_ranks(_record_and_replay, 2, timeout_s=120, env={"OMP_NUM_THREADS": "1"}):
        assert r["total"] == 6.0  # the recorded code ran for real: (1 + 2) x 2
        assert r["names"] == ["allreduce_", "allreduce_", "allreduce_", "_allgather_base_",
                              "_reduce_scatter_base_"]
        assert r["bytes"] == [4096, 4096, 1024, 8192 + 4096, 2048 + 4096]
        # one flat buffer per fp32 position of a call, not one per call or shape: the
        # first tensors (1024, 1024, 256, the all-gather's 2048 output, the reduce-scatter's
        # 512 output) share 8 KiB, the second (the two 1024-element inputs) 4 KiB
        assert r["buffer_bytes"] == 8192 + 4096
        assert "barrier" in r["skipped"] and any(s in r["skipped"] for s in ("send", "recv_"))
        assert all(0 < t < 30 for t in r["times"]), r["times"]
        assert r["x_after"] == 6.0  # a replay works on its own tensors, not the recorded ones
