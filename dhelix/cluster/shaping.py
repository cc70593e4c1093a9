"""The `tc` commands that shape one node's link to the switch.

Each node's link is a full-duplex "NIC": the node's `eth0` egress limits what the node
sends (its uplink), the switch port's egress limits what it receives (its downlink). A
packet between two nodes crosses the sender's uplink and the receiver's downlink, so each
direction of each node is capped at the bandwidth, as on a real switched network.

- Bandwidth: a token-bucket filter (`tbf`) on both ends. Its bucket (burst) holds 1 ms
  of traffic at line rate (at least 16 KiB; tbf splits larger GSO packets to fit), so
  sustained traffic gets the rate, and after an idle link at most 1 ms worth of bytes
  passes unshaped. A smaller bucket would shape small messages more faithfully but makes
  tbf's timers fire so often that, on a machine with few cores, the link's packet
  handling competes with the computation and communication becomes CPU-bound again
  (measured: 0.25 ms at 800 Mbit/s slowed a 16 MB all_reduce from 0.18 s to 0.3-0.5 s
  and the overlap check fell from ~1.6x to ~1.1x). Its queue holds about 50 ms of
  traffic, enough for TCP to keep the link full without drops.
- Latency: a `netem delay` on the uplink only (root qdisc, with the tbf as its child), so
  the one-way node-to-node latency is the given value and a round trip twice it. It needs
  the kernel's netem qdisc (sch_netem); kernels without it cannot emulate latency, and the
  cluster then refuses a non-zero `--latency` with a message saying so.

These functions only build argument lists; `network.EmulatedNetwork` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhelix.cluster.units import format_rate, format_time

BURST_S = 1e-3           # tbf bucket: this long at line rate ...
MIN_BURST_BYTES = 16384  # ... but at least this (ten or more full-size packets)
QUEUE_S = 0.05          # tbf queue: this long at line rate ...
MIN_QUEUE_BYTES = 256 * 1024
NETEM_LIMIT_PACKETS = 100_000  # netem's default (1000) drops bursts at high bandwidth


@dataclass(frozen=True)
class LinkShape:
    """One cross-node link: bandwidth in bit/s (None: unshaped) and one-way latency in s."""

    bandwidth: int | None
    latency: float = 0.0

    def __post_init__(self):
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be positive or None, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"latency must be >= 0, got {self.latency}")

    def describe(self) -> str:
        return f"{format_rate(self.bandwidth)}, {format_time(self.latency)} one-way"

    @property
    def burst_bytes(self) -> int:
        return max(MIN_BURST_BYTES, int(self.bandwidth / 8 * BURST_S))

    @property
    def queue_bytes(self) -> int:
        return max(MIN_QUEUE_BYTES, int(self.bandwidth / 8 * QUEUE_S))


def _tbf(shape: LinkShape) -> list[str]:
    return ["tbf", "rate", f"{shape.bandwidth}bit", "burst", str(shape.burst_bytes),
            "limit", str(shape.queue_bytes)]


def uplink_commands(namespace: str, device: str, shape: LinkShape) -> list[list[str]]:
    """`tc` argument lists for a node's own interface: latency (netem) and bandwidth (tbf)."""
    base = ["-n", namespace, "qdisc", "add", "dev", device]
    commands = []
    if shape.latency > 0:
        delay_us = max(1, round(shape.latency * 1e6))
        commands.append(base + ["root", "handle", "1:", "netem", "delay", f"{delay_us}us",
                                "limit", str(NETEM_LIMIT_PACKETS)])
        if shape.bandwidth is not None:
            commands.append(base + ["parent", "1:1", "handle", "10:"] + _tbf(shape))
    elif shape.bandwidth is not None:
        commands.append(base + ["root", "handle", "1:"] + _tbf(shape))
    return commands


def downlink_commands(namespace: str, device: str, shape: LinkShape) -> list[list[str]]:
    """`tc` argument lists for the switch port facing a node: bandwidth only."""
    if shape.bandwidth is None:
        return []
    return [["-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:"]
            + _tbf(shape)]
