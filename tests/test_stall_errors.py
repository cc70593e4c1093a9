"""Which errors start the stall roll call (`dhelix.stall.is_communication_failure`): gloo's
messages when a peer stops answering or goes away, and nothing else."""

import pytest
import torch.distributed as dist

from dhelix.stall import is_communication_failure


@pytest.mark.parametrize("message", [
    "Timed out waiting 60000ms for recv operation to complete",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1",
    "Connection reset by peer",
    # a second wait on the group after a first collective timed out (seen with the streamed
    # executor: both strands' collectives share one group)
    "Application timeout caused pair closure",
])
def test_gloo_peer_failures_start_the_roll_call(message):
    assert is_communication_failure(RuntimeError(message))


def test_other_errors_do_not():
    assert not is_communication_failure(RuntimeError("CUDA out of memory"))
    assert not is_communication_failure(ValueError("Timed out"))  # not a collective's error
    assert is_communication_failure(dist.DistBackendError("anything"))
