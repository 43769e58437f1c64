"""SM clock and board power of this GPU, sampled while a measurement runs (NVML through torch)."""

from __future__ import annotations

import statistics
import threading

import torch


class Sampler:
    """Mean SM clock (MHz) and power (W) of this GPU over every ``with`` block it was entered for
    (NVML, every 5 ms); ``clock``/``power`` stay ``None`` where NVML is unavailable."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def clock(self) -> float | None:
        return statistics.mean(c for c, _ in self._samples) if self._samples else None

    @property
    def power(self) -> float | None:
        return statistics.mean(p for _, p in self._samples) if self._samples else None

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))

    def __enter__(self) -> Sampler:
        try:
            torch.cuda.clock_rate(), torch.cuda.power_draw()
        except Exception:  # noqa: BLE001 - no pynvml / NVML: no samples
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
