"""The severity table of paper Table 1 for exception propagation (pure).

One ordered table of (pattern, severity, kind); the first pattern that matches
the exception's type name or message wins. Plugins extend it through the
``unicron_classify_exception`` hook, which is consulted first.

| error status | severity |
| --- | --- |
| connection refused / reset | SEV3 |
| illegal memory access | SEV2 |
| ECC errors | SEV1 |
| invalid DMA mapping | SEV1 |
| NVLink errors | SEV1 |
| GPU driver errors | SEV1 |
| CUDA errors | SEV2 |
| other network errors | SEV3 |
| other software errors | SEV2 |

One row of our own comes first: :class:`~unicron_elastic.api.NonFiniteError`
(a step's loss or gradients hold a NaN or Inf and no loss scaler skips it) is
SEV1 ``non_finite``. Every rank raises it at the same step and a restart would
only compute the same NaN again, so the node gives up at once and the job ends
with the error (Megatron-LM stops the same way on its NaN check). Likewise
:class:`~unicron_elastic.slurm.api.ForeignCheckpoint` (a preemption checkpoint
of another SLURM job or array task) is SEV1 ``foreign_checkpoint``: every
restart would refuse it again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from unicron_elastic.events import Classification, Severity


@dataclass(frozen=True)
class Rule:
    """One row of the table."""

    pattern: re.Pattern[str]
    severity: Severity
    kind: str


def _rule(pattern: str, severity: Severity, kind: str) -> Rule:
    return Rule(re.compile(pattern, re.IGNORECASE), severity, kind)


#: Ordered: hardware (SEV1) before the generic CUDA row, network rows last.
SEVERITY_TABLE: tuple[Rule, ...] = (
    _rule(r"^NonFiniteError:", Severity.SEV1, "non_finite"),
    _rule(r"^ForeignCheckpoint:", Severity.SEV1, "foreign_checkpoint"),
    _rule(r"connection (refused|reset)|ECONNREFUSED|ECONNRESET|connection closed by peer", Severity.SEV3, "connection_reset"),
    _rule(r"illegal memory access", Severity.SEV2, "illegal_memory_access"),
    _rule(r"\bECC\b|uncorrectable ECC|ecc error", Severity.SEV1, "ecc"),
    _rule(r"invalid (DMA|device) mapping|DMA mapping", Severity.SEV1, "invalid_dma_mapping"),
    _rule(r"NVLink", Severity.SEV1, "nvlink"),
    _rule(r"driver (version|error|shutting down)|GPU (driver|has fallen off the bus)|\bXid\b|NVML_ERROR", Severity.SEV1, "gpu_driver"),
    _rule(r"\bCUDA\b|cudaError|CUBLAS_STATUS|CUDNN_STATUS", Severity.SEV2, "cuda"),
    _rule(r"NCCL|gloo|socket|timed? ?out|network|unreachable|broken pipe|EPIPE|ETIMEDOUT|ConnectionError", Severity.SEV3, "network"),
)

OTHER_SOFTWARE = Classification(Severity.SEV2, "software")


def classify(exc_type: str, message: str) -> Classification:
    """Classify an exception by the table; anything else is "other software" (SEV2).

    Args:
        exc_type: The exception's type name (e.g. ``RuntimeError``).
        message: Its message (first lines suffice).

    Returns:
        The classification.
    """
    text = f"{exc_type}: {message}"
    for rule in SEVERITY_TABLE:
        if rule.pattern.search(text):
            return Classification(rule.severity, rule.kind)
    return OTHER_SOFTWARE
