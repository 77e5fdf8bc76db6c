"""The agent's NVML detector on a real NVIDIA driver (a lent GPU; not collected by pytest).

Run from the repository root on a machine with an NVIDIA GPU, after installing the package::

    OUT=/tmp/check python tests/gpu/nvml_check.py

No CPU test can reach NVML. This checks that :class:`~unicron_elastic.agent.detectors.NvmlDetector` starts
(``available``), which of its counters the GPU answers (:func:`nvml_counters`, and each NVML call's answer or
error, per NVLink link too), and that polling a healthy GPU for ``SECONDS`` reports no event. One JSON object is
printed and written to ``$OUT/nvml.json``; the exit code is 1 when the detector is not available, reads no
counter at all, or reports an event.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from unicron_elastic.agent.detectors import NvmlDetector, nvml_counters

OUT = Path(os.environ.get("OUT", "/tmp/check"))
SECONDS = 5.0


class Context:
    """The agent as the detector sees it: events are collected."""

    node = "gpu-check"
    store = None

    def __init__(self) -> None:
        self.events: list[str] = []

    def report(self, event: object) -> None:
        self.events.append(repr(event))


def readings(nv: object, handle: object) -> dict[str, object]:
    """Each counter the detector reads, as NVML answers it on this GPU."""
    calls = {
        "ecc": lambda: nv.nvmlDeviceGetTotalEccErrors(handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                      nv.NVML_VOLATILE_ECC),
        "retired_pages": lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(handle),
        "remapped_rows (corrected, uncorrectable, pending, failure)": lambda: nv.nvmlDeviceGetRemappedRows(handle),
    }
    found: dict[str, object] = {}
    for name, call in calls.items():
        try:
            answer = call()
            found[name] = [int(v) for v in answer] if isinstance(answer, (tuple, list)) else int(answer)
        except Exception as exc:  # noqa: BLE001 - what NVML says is the finding
            found[name] = f"error: {exc}"
    links = {}
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            links[link] = int(nv.nvmlDeviceGetNvLinkErrorCounter(handle, link, 0))
        except Exception as exc:  # noqa: BLE001
            links[link] = f"error: {exc}"
    found["nvlink_per_link"] = links
    return found


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    detector, ctx = NvmlDetector(interval=0.5), Context()
    detector.start(ctx)
    result: dict[str, object] = {"available": detector.available}
    if detector.available:
        nv = detector._nvml
        result["gpus"] = [{"name": str(nv.nvmlDeviceGetName(h)), "nvml_counters": nvml_counters(nv, h),
                           **readings(nv, h)} for h in detector._handles]
        result["counters_read"] = sorted({kind for (_, kind) in detector._baseline})
        time.sleep(SECONDS)
        detector.stop()
    result["events"] = ctx.events
    text = json.dumps(result, indent=1, default=str)
    print(text)
    (OUT / "nvml.json").write_text(text)
    return 0 if detector.available and result.get("counters_read") and not ctx.events else 1


if __name__ == "__main__":
    sys.exit(main())
