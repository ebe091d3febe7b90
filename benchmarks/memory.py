"""Resident memory of this process, and a thread that samples its peak (Linux /proc)."""

from __future__ import annotations

import threading

__all__ = ["PeakSampler", "resident"]


def resident() -> dict[str, int]:
    """Resident bytes: ``RssAnon`` (data), ``RssFile`` (file-backed: library code paged in), and ``Held``.

    ``Held`` is ``RssAnon`` plus the host's shared memory (``Shmem`` of /proc/meminfo): a `gather`
    result placed in a memfd, or a Collector's segments, are shared memory that this process may not
    have touched yet (a sender wrote it), so its own ``RssShmem`` would miss them. On a host running
    only the benchmark, the change in ``Shmem`` is the job's.
    """
    out = {"RssAnon": 0, "RssFile": 0}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1]) * 1024
    shmem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("Shmem:"):
                shmem = int(line.split()[1]) * 1024
    out["Held"] = out["RssAnon"] + shmem
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
