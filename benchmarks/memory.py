"""Resident memory of this process, and a thread that samples its peak (Linux /proc)."""

from __future__ import annotations

import threading

__all__ = ["PeakSampler", "resident"]


def resident() -> dict[str, int]:
    """Resident bytes: ``RssAnon`` (data) and ``RssFile`` (file-backed: library code paged in)."""
    out = {"RssAnon": 0, "RssFile": 0}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1]) * 1024
    return out


class PeakSampler:
    """Samples resident memory every ``interval`` seconds; `stop` returns the peaks above `reset`'s values."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.base = resident()
        self.peak = dict.fromkeys(self.base, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.base = resident()
        self.peak = dict.fromkeys(self.base, 0)

    def _sample(self) -> None:
        now = resident()
        for k in self.peak:
            self.peak[k] = max(self.peak[k], now[k] - self.base[k])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> dict[str, int]:
        """Take a last sample and return the peaks so far (the thread keeps sampling until `close`)."""
        self._sample()
        return dict(self.peak)

    def close(self) -> dict[str, int]:
        peaks = self.stop()
        self._stop.set()
        self._thread.join()
        return peaks
