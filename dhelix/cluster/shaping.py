"""The `tc` commands that shape one node's link to the switch.

Each node's link is a full-duplex "NIC": the node's `eth0` egress limits what the node
sends (its uplink), the switch port's egress limits what it receives (its downlink). A
packet between two nodes crosses the sender's uplink and the receiver's downlink, so each
direction of each node is capped at the bandwidth, as on a real switched network.

- Bandwidth: a token-bucket filter (`tbf`) on both ends. Its bucket (burst) holds 2 ms
  of traffic at line rate (at least 16 KiB), so sustained traffic gets the rate and after
  an idle link at most 2 ms worth of bytes passes unshaped. Its queue holds about 50 ms of
  traffic, enough for TCP to keep the link full without drops.
- Packet size: the veth ends' `gso_max_size` is capped so that one GSO packet fits in the
  bucket (`LinkShape.gso_max_bytes`). tbf splits a GSO packet larger than its bucket into
  segments, and under CPU load those segments reach TCP reordered or late: the sender
  fast-retransmits, halves its window and the link runs far below its rate exactly while
  the cores compute. Measured (`scripts/overlap_check.py`, 16 MB all_reduce, 2 nodes x 1
  rank): with a 1 ms bucket and 64 KiB GSO packets, 400 Mbit/s hid 16-31% with 140-360
  TCP retransmissions per run, against 0-2 retransmissions and 87-100% hidden once every
  packet fitted its bucket (800 Mbit/s always fitted, which is why only lower rates broke).
  Timer wake-ups stay at about one per bucket (2 ms), so the link's packet handling does
  not compete with the computation: a smaller bucket (0.25 ms at 800 Mbit/s) slowed a
  16 MB all_reduce from 0.18 s to 0.3-0.5 s.
- Latency: a `netem delay` on the uplink only (root qdisc, with the tbf as its child), so
  the one-way node-to-node latency is the given value and a round trip twice it. It needs
  the kernel's netem qdisc (sch_netem); kernels without it cannot emulate latency, and the
  cluster then refuses a non-zero `--latency` with a message saying so.

These functions only build argument lists (`tc`'s, and `ip`'s for GSO); `network.EmulatedNetwork` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhelix.cluster.units import format_rate, format_time

BURST_S = 2e-3           # tbf bucket: this long at line rate ...
MIN_BURST_BYTES = 16384  # ... but at least this (ten or more full-size packets)
MAX_GSO_BYTES = 65536    # the kernel's largest GSO packet
GSO_HEADROOM_BYTES = 1500  # room for the headers tbf counts beyond TCP's payload
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
    def gso_max_bytes(self) -> int:
        """Largest GSO packet the link's interfaces may build: one must fit in the bucket
        (see the module docstring)."""
        return min(MAX_GSO_BYTES, self.burst_bytes - GSO_HEADROOM_BYTES)

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


def gso_commands(namespace: str, device: str, shape: LinkShape) -> list[list[str]]:
    """`ip` argument lists capping `device`'s GSO packets to fit the bucket (none unshaped)."""
    if shape.bandwidth is None:
        return []
    return [["-n", namespace, "link", "set", "dev", device, "gso_max_size",
             str(shape.gso_max_bytes)]]


def downlink_commands(namespace: str, device: str, shape: LinkShape) -> list[list[str]]:
    """`tc` argument lists for the switch port facing a node: bandwidth only."""
    if shape.bandwidth is None:
        return []
    return [["-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:"]
            + _tbf(shape)]
