"""An example third-party plugin for unicron_elastic.

Install it (``pip install -e examples/unicron-plugin-example``) and enable its
detector with ``unicron-run --detectors node,process,exception,hang,nvml,memory``.

* Detector ``memory``: reads ``/proc/meminfo`` every second; when the node has
  less than ``$UNICRON_MEMORY_MIN_MB`` (default 512) MiB available it reports a
  SEV1 ``memory_pressure`` event for the node (which then gives up its work).
* Classification: ``No space left on device`` is SEV1 ``disk_full``.
* ``$UNICRON_EXAMPLE_CRASH=1`` makes its ``unicron_event`` hook raise, to show
  that a broken plugin is isolated.
"""

from __future__ import annotations

import os
import threading

from unicron_elastic.agent.detectors import Detector
from unicron_elastic.events import Classification, ErrorEvent, Severity
from unicron_elastic.plugins import hookimpl


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


class MemoryPressureDetector(Detector):
    name = "memory"

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.minimum = float(os.environ.get("UNICRON_MEMORY_MIN_MB", "512"))
        self._stop = threading.Event()

    def start(self, ctx) -> None:
        super().start(ctx)
        threading.Thread(target=self._run, daemon=True, name="memory-detector").start()

    def _run(self) -> None:
        while True:
            free = available_mb()
            if free < self.minimum:
                self.ctx.report(ErrorEvent(Severity.SEV1, "memory_pressure", self.name, self.ctx.node,
                                           message=f"{free:.0f} MiB available < {self.minimum:.0f} MiB"))
                return
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()


@hookimpl
def unicron_detectors(config):
    return [MemoryPressureDetector()]


@hookimpl
def unicron_classify_exception(exc_type, message, traceback):
    if "No space left on device" in message:
        return Classification(Severity.SEV1, "disk_full")
    return None


@hookimpl
def unicron_event(event):
    if os.environ.get("UNICRON_EXAMPLE_CRASH") == "1":
        raise RuntimeError("example plugin crashed on purpose")
