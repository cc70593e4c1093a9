"""Name the ranks that stopped answering when a collective times out.

When a rank stops (SIGSTOP, a hang, a dead host), the others wait in their next collective
until the process-group timeout (`--distributed-timeout-minutes`) and then get a bare gloo
error ("Timed out waiting 45000ms for recv operation to complete") that names no rank.
`StallGuard.explain` turns it into one line that does: every rank whose collective failed
checks in under a key of the rendezvous store (under torchrun the store lives in the agent,
so it answers while any rank is stalled) and waits a short window; the ranks that did not
check in are the ones that stopped answering.

Guarantees:
- Only a communication failure (gloo timeout, connection closed/reset by a peer) starts a
  roll call; any other exception is left to the caller, so a rank's own bug is never blamed
  on the others.
- The lowest rank that checked in reports (one line); the others wait for its report before
  returning, so torchrun does not tear the reporter down mid-sentence.
- A stalled rank on this host is killed (SIGKILL, after checking its pid still belongs to
  it), so the job ends now rather than after torchrun's 30 s grace period (a stopped process
  ignores torchrun's SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import psutil

from dhelix.parallel import Job

# Substrings of the errors gloo raises when a peer stops answering or goes away. "pair
# closure": a wait on a collective whose connection gloo closed when another collective of
# the same group timed out (the streamed executor's two strands share one group per channel).
COMMUNICATION_FAILURES = ("Timed out", "timed out", "Connection closed by peer",
                          "Connection reset by peer", "Broken pipe",
                          "Application timeout caused pair closure")


class RankStalled(RuntimeError):
    """Ranks stopped answering; the message is one line naming them."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def is_communication_failure(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer stalls or dies."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in COMMUNICATION_FAILURES)


def _this_process() -> dict:
    proc = psutil.Process()
    return {"host": socket.gethostname(), "pid": proc.pid, "start": proc.create_time()}


@dataclass
class StallGuard:
    """One rank's view of the job for naming stalled ranks (`for_job` builds it)."""

    store: object
    rank: int
    world_size: int
    timeout_s: float

    @classmethod
    def for_job(cls, job: Job) -> "StallGuard | None":
        """The guard of this process, holding `job`'s store and timeout (None for a group
        created elsewhere, `Job()`: no store to hold a roll call in). Publishes this rank's
        host and pid in the store (no collective)."""
        import torch.distributed as dist

        if job.created_elsewhere:
            return None
        guard = cls(job.store, dist.get_rank(), dist.get_world_size(),
                    job.timeout.total_seconds())
        job.store.set(f"process/{guard.rank}", json.dumps(_this_process()))
        return guard

    @property
    def window_s(self) -> float:
        """How long a roll call waits for the others: ranks blocked behind a blocked rank
        time out up to about one step later than the first."""
        return max(2.0, min(15.0, 0.2 * self.timeout_s))

    def _checked_in(self) -> list[int]:
        return [r for r in range(self.world_size) if self.store.check([f"roll_call/{r}"])]

    def roll_call(self) -> list[int]:
        """Check in, wait up to `window_s` for every rank; returns those that did not."""
        self.store.set(f"roll_call/{self.rank}", "1")
        deadline = time.monotonic() + self.window_s
        present = self._checked_in()
        while len(present) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.1)
            present = self._checked_in()
        return sorted(set(range(self.world_size)) - set(present))

    def _kill_if_local(self, rank: int) -> str:
        try:
            info = json.loads(self.store.get(f"process/{rank}"))
        except Exception:  # noqa: BLE001 - never published: nothing to act on
            return ""
        where = f"pid {info['pid']} on {info['host']}"
        if info["host"] != socket.gethostname():
            return where
        try:
            proc = psutil.Process(info["pid"])
            if abs(proc.create_time() - info["start"]) < 1e-3:
                os.kill(info["pid"], signal.SIGKILL)
                return where + ", killed"
        except (psutil.Error, ProcessLookupError):
            pass
        return where

    def explain(self, exc: BaseException, report: Callable[[str], None]) -> RankStalled | None:
        """After `exc` from a collective: name the ranks that stopped answering, `report`
        the one-line message on the lowest rank that answered, and return it as RankStalled.
        None when `exc` is no communication failure or every rank answered (then the caller
        re-raises `exc`)."""
        if not is_communication_failure(exc):
            return None
        missing = self.roll_call()
        if not missing:
            return None
        details = "; ".join(f"rank {r}: {self._kill_if_local(r)}" for r in missing)
        minutes = self.timeout_s / 60
        names = ", ".join(map(str, missing))
        message = (
            f"rank{'s' if len(missing) > 1 else ''} {names} of {self.world_size} stopped "
            f"answering: a collective waited --distributed-timeout-minutes {minutes:g} "
            f"({self.timeout_s:g} s) and {'they' if len(missing) > 1 else 'it'} did not "
            f"answer a roll call within {self.window_s:g} s ({details}); the job stops. If "
            f"{'they were' if len(missing) > 1 else 'it was'} only slow (a long save or "
            "first step), raise --distributed-timeout-minutes")
        reporter = min(set(range(self.world_size)) - set(missing))
        if self.rank == reporter:
            report(message)
            self.store.set("roll_call/reported", "1")
        else:
            try:
                self.store.wait(["roll_call/reported"], timedelta(seconds=self.window_s))
            except Exception:  # noqa: BLE001 - the reporter is gone too; stop anyway
                pass
        return RankStalled(message, missing)
