"""Parse the link options (`--bandwidth 800mbit`, `--latency 1ms`) into numbers, with
messages that name the option and show valid spellings.

Rates follow tc's units, in bits per second with decimal prefixes (`kbit`, `mbit`, `gbit`;
`bit` alone), or `unlimited` for an unshaped link. Times take `us`, `ms` or `s`.
"""

from __future__ import annotations

import re

RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
UNLIMITED = "unlimited"

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_rate(text: str, option: str = "--bandwidth") -> int | None:
    """Bits per second as an int, or None for `unlimited`.

    Raises ValueError naming `option` for anything else, including zero or a missing unit.
    """
    if text.strip().lower() == UNLIMITED:
        return None
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in RATE_UNITS:
        raise ValueError(
            f"{option} {text!r}: expected a number with a unit ({', '.join(RATE_UNITS)}), "
            f"e.g. 800mbit, or {UNLIMITED!r}"
        )
    bits = round(float(match.group(1)) * RATE_UNITS[unit])
    if bits < 8000:
        raise ValueError(f"{option} {text!r}: below 8kbit; use at least 8kbit")
    return bits


def parse_time(text: str, option: str = "--latency") -> float:
    """Seconds as a float (zero allowed). Raises ValueError naming `option`."""
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in TIME_UNITS:
        raise ValueError(
            f"{option} {text!r}: expected a number with a unit ({', '.join(TIME_UNITS)}), "
            "e.g. 1ms or 0ms"
        )
    return float(match.group(1)) * TIME_UNITS[unit]


def format_rate(bits_per_s: int | None) -> str:
    """Human-readable rate: `800mbit`, `1.5gbit`, or `unlimited`."""
    if bits_per_s is None:
        return UNLIMITED
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = RATE_UNITS[unit]
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s}bit"


def format_time(seconds: float) -> str:
    """Human-readable time: `1ms`, `250us`, `0ms`."""
    if seconds == 0:
        return "0ms"
    if seconds < 1e-3:
        return f"{seconds * 1e6:g}us"
    if seconds < 1:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds:g}s"
