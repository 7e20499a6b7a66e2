"""How far a long pass over the frozen base (loading it, fingerprinting it) has got, and when to say so."""

from __future__ import annotations

import time

# a pass shorter than this logs nothing; a longer one logs a line this often, so a large base never looks hung
INTERVAL_SECONDS = 5.0


class Progress:
    """Counts the items (tensors) and units (bytes, elements) of a pass over ``total`` units."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.items = 0
        self.started = self.last_due = time.monotonic()

    def advance(self, amount: int) -> bool:
        """Count one item of ``amount`` units; True when ``INTERVAL_SECONDS`` (read at each call, so a test can
        patch it) have passed since the last True."""
        self.done += amount
        self.items += 1
        now = time.monotonic()
        if now - self.last_due <= INTERVAL_SECONDS:
            return False
        self.last_due = now
        return True

    @property
    def percent(self) -> float:
        return 100 * self.done / max(self.total, 1)

    def status(self, unit: str, scale: int = 1) -> str:
        """``"<done> of <total> <unit> (<percent>) in <s>, <rate> <unit>/s, about <s> left"``; amounts divided by
        ``scale`` (``2**20`` for MiB)."""
        done, total, seconds = self.done / scale, self.total / scale, self.seconds
        rate = done / seconds
        digits = 1 if scale > 1 else 0
        line = f"{done:,.{digits}f} of {total:,.{digits}f} {unit} ({self.percent:.0f}%)"
        line += f" in {seconds:.1f} s, {rate:,.1f} {unit}/s"
        if done < total:
            line += f", about {(total - done) / rate:,.0f} s left" if rate > 0 else ""
        return line

    @property
    def seconds(self) -> float:
        """Seconds since the pass started (never 0, so a rate can be divided by it)."""
        return max(time.monotonic() - self.started, 1e-9)
