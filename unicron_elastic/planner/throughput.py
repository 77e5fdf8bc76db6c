"""Throughput model T(t, x): achieved aggregate FLOP/s of a GPT task on x GPUs.

An analytic model of Megatron-LM training, searched over tensor (TP), pipeline
(PP) and data (DP) parallel degrees and the micro-batch size under the GPU
memory limit. Assumptions (see docs/planner.md for the discussion):

* FLOPs per iteration (Narayanan et al., SC'21, eq. 3, without the recompute
  term): ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``; T counts these *model*
  FLOPs. With full activation recomputation the GPUs execute 4/3 of them
  (the ``hardware_flops`` field), as Megatron reports.
* A run uses exactly ``x = TP * PP * DP`` GPUs; the global batch B must split
  into ``DP * micro_batch * m`` with m micro-batches per pipeline. Sizes with no
  such configuration are infeasible (T = 0): this is what makes T jagged and
  non-monotonic (paper section 2.4, O2).
* Time of one iteration (1F1B schedule)::

      (m + PP - 1) * (t_compute + t_tp + t_p2p) + t_dp

  t_compute: the stage's FLOPs of one micro-batch at ``peak * eff`` where
  ``eff = eff_max * g / (g + g0)`` saturates with the GEMM size
  ``g = micro_batch * s * h / TP``; the last stage also computes the LM head
  (the ``V/(12 l h)`` share of the FLOPs) and sets the pipeline's pace; t_tp: 4 (6 with recomputation) ring
  all-reduces of the activations per layer; t_p2p: activations sent between
  stages; t_dp: ring all-reduce of fp32 gradients, not overlapped.
* TP groups stay inside a node (TP <= GPUs per node, TP divides the heads);
  PP divides the layers. Bandwidths: NVLink inside a node, the per-GPU share of
  the node's network across nodes.
* Memory per GPU: 16 bytes per parameter (fp16 weights and gradients, fp32
  master weights and Adam moments) of the stage's share, plus activations
  (Korthikanti et al., 2022): without recomputation
  ``s b h (10 + 24/TP + 5 a s/(h TP))`` bytes per layer for each of the PP
  micro-batches in flight; with full recomputation ``2 s b h`` bytes per layer
  plus one layer's full working set. Recomputation is used only when needed.

A calibration table (measured T per task name and x) overrides the model.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from unicron_elastic.api import ConfigError, finite_positive, lookup


@dataclass(frozen=True)
class GpuType:
    """A GPU and the machine it sits in.

    Attributes:
        name: Catalogue name.
        peak_flops: Dense fp16/bf16 tensor-core peak, FLOP/s.
        memory_bytes: Device memory.
        gpus_per_node: GPUs in one node.
        intra_node_bw: Bytes/s between GPUs of a node (NVLink, one direction).
        inter_node_bw: Bytes/s per GPU between nodes (node NIC bandwidth / GPUs).
        eff_max: Best fraction of peak a large GEMM reaches.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    gpus_per_node: int = 8
    intra_node_bw: float = 300e9
    inter_node_bw: float = 25e9
    eff_max: float = 0.8

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.memory_bytes <= 0 or self.gpus_per_node < 1:
            raise ConfigError(f"GPU type {self.name!r}: peak, memory and GPUs per node must be positive")


GB = 1024**3

#: Known GPU types. A800 is the A100 for the Chinese market (NVLink 400 GB/s);
#: the paper's cluster has 4 x 200 Gb/s Ethernet per 8-GPU instance.
GPU_TYPES: dict[str, GpuType] = {
    "A100-40GB": GpuType("A100-40GB", 312e12, 40 * GB, 8, 300e9, 25e9),
    "A100-80GB": GpuType("A100-80GB", 312e12, 80 * GB, 8, 300e9, 25e9),
    "A800-80GB": GpuType("A800-80GB", 312e12, 80 * GB, 8, 200e9, 12.5e9),
    "H100-80GB": GpuType("H100-80GB", 989e12, 80 * GB, 8, 450e9, 50e9),
    "H800-80GB": GpuType("H800-80GB", 989e12, 80 * GB, 8, 200e9, 50e9),
}


def gpu_type(name: str) -> GpuType:
    """Look up a GPU type by name.

    Raises:
        ConfigError: The name is unknown; the message lists the known ones.
    """
    return lookup(GPU_TYPES, "GPU type", name)


@dataclass(frozen=True)
class GptModel:
    """A GPT model and its training batch.

    Attributes:
        name: Name (also the key of calibration entries).
        layers: Transformer layers.
        hidden: Hidden size.
        heads: Attention heads.
        seq_len: Sequence length.
        vocab: (Padded) vocabulary size.
        global_batch: Sequences per iteration.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int = 2048
    vocab: int = 51200
    global_batch: int = 512

    def __post_init__(self) -> None:
        for attr in ("layers", "hidden", "heads", "seq_len", "vocab", "global_batch"):
            if getattr(self, attr) < 1:
                raise ConfigError(f"model {self.name!r}: {attr} must be >= 1")
        if self.hidden % self.heads:
            raise ConfigError(f"model {self.name!r}: hidden {self.hidden} not divisible by heads {self.heads}")

    @property
    def parameters(self) -> float:
        """Parameter count: 12 l h^2 (1 + 13/(12h)) + (V + s) h."""
        h, l = self.hidden, self.layers
        return 12 * l * h * h * (1 + 13 / (12 * h)) + (self.vocab + self.seq_len) * h

    @property
    def flops_per_iteration(self) -> float:
        """Model FLOPs of one iteration (forward + backward, no recomputation)."""
        b, s, l, h, v = self.global_batch, self.seq_len, self.layers, self.hidden, self.vocab
        return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


#: The GPT-3 family of the paper's evaluation (Brown et al. 2020, Table 2.1; 70B
#: shaped like Llama-2 70B). Global batches follow Megatron-LM's published runs.
MODELS: dict[str, GptModel] = {
    "1.3B": GptModel("1.3B", 24, 2048, 16, global_batch=512),
    "2.7B": GptModel("2.7B", 32, 2560, 32, global_batch=512),
    "7B": GptModel("7B", 32, 4096, 32, global_batch=1024),
    "13B": GptModel("13B", 40, 5120, 40, global_batch=1024),
    "70B": GptModel("70B", 80, 8192, 64, global_batch=1536),
    "175B": GptModel("175B", 96, 12288, 96, global_batch=1536),
}


def model(name: str) -> GptModel:
    """Look up a model of :data:`MODELS`.

    Raises:
        ConfigError: The name is unknown.
    """
    return lookup(MODELS, "model", name)


@dataclass(frozen=True)
class ParallelConfig:
    """One Megatron configuration."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    recompute: bool

    @property
    def gpus(self) -> int:
        """GPUs used: TP * PP * DP."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Estimate:
    """T(t, x) with the configuration that achieves it.

    Attributes:
        flops: Achieved aggregate model FLOP/s (0 if infeasible).
        config: The best configuration (None if infeasible).
        iteration_time: Seconds per iteration.
        hardware_flops: FLOP/s the GPUs execute (incl. recomputation).
        memory_bytes: Peak memory per GPU of the configuration.
    """

    flops: float
    config: ParallelConfig | None = None
    iteration_time: float = math.inf
    hardware_flops: float = 0.0
    memory_bytes: float = 0.0

    @property
    def feasible(self) -> bool:
        """True if some configuration fits."""
        return self.config is not None


INFEASIBLE = Estimate(0.0)

#: GEMM size (micro_batch * seq * hidden / TP) at which half of ``eff_max`` is reached.
GEMM_HALF_EFFICIENCY = 3.0e6


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def memory_per_gpu(m: GptModel, c: ParallelConfig) -> float:
    """Peak bytes per GPU of the first pipeline stage (the fullest)."""
    h, s, a, b = m.hidden, m.seq_len, m.heads, c.micro_batch
    layer_params = 12 * h * h + 13 * h
    stage_params = layer_params * m.layers / c.pp + (m.vocab + s) * h  # first stage holds embeddings
    states = 16.0 * stage_params / c.tp
    layers_here = m.layers / c.pp
    full_layer = s * b * h * (10 + 24 / c.tp + 5 * a * s / (h * c.tp))
    in_flight = min(c.pp, max(1, m.global_batch // (c.dp * b)))
    if c.recompute:
        activations = 2.0 * s * b * h * layers_here * in_flight + full_layer
    else:
        activations = full_layer * layers_here * in_flight
    return states + activations


def iteration_time(m: GptModel, g: GpuType, c: ParallelConfig) -> float:
    """Seconds per iteration of configuration ``c`` (see module docstring)."""
    s, h = m.seq_len, m.hidden
    micro_batches = m.global_batch // (c.dp * c.micro_batch)
    per_sample = m.flops_per_iteration / m.global_batch
    logits = 72.0 * s * m.layers * h * h * m.vocab / (12 * m.layers * h)
    layers = per_sample - logits
    # the last stage also computes the LM head: the pipeline runs at its pace
    stage_flops = (layers / c.pp + logits) * c.micro_batch / c.tp * (4 / 3 if c.recompute else 1)
    gemm = c.micro_batch * s * h / c.tp
    eff = g.eff_max * gemm / (gemm + GEMM_HALF_EFFICIENCY)
    t_compute = stage_flops / (g.peak_flops * eff)
    act_bytes = 2.0 * c.micro_batch * s * h
    tp_bw = g.intra_node_bw if c.tp <= g.gpus_per_node else g.inter_node_bw
    t_tp = 0.0
    if c.tp > 1:
        t_tp = (6 if c.recompute else 4) * (m.layers / c.pp) * 2 * (c.tp - 1) / c.tp * act_bytes / tp_bw
    p2p_bw = g.inter_node_bw if c.tp * c.dp >= g.gpus_per_node else g.intra_node_bw
    t_p2p = 2 * act_bytes / c.tp / p2p_bw if c.pp > 1 else 0.0
    t_dp = 0.0
    if c.dp > 1:
        grad_bytes = 4.0 * m.parameters / (c.tp * c.pp)
        dp_bw = g.inter_node_bw if c.tp * c.dp > g.gpus_per_node else g.intra_node_bw
        t_dp = 2 * (c.dp - 1) / c.dp * grad_bytes / dp_bw
    return (micro_batches + c.pp - 1) * (t_compute + t_tp + t_p2p) + t_dp


def _configs(m: GptModel, g: GpuType, x: int, model_parallel: int = 0):
    for tp in _divisors(m.heads):
        if tp > g.gpus_per_node or x % tp:
            continue
        for pp in _divisors(m.layers):
            if (x // tp) % pp or (model_parallel and tp * pp != model_parallel):
                continue
            dp = x // (tp * pp)
            if m.global_batch % dp:
                continue
            for mb in (1, 2, 4, 8):
                if (m.global_batch // dp) % mb:
                    continue
                yield tp, pp, dp, mb


@lru_cache(maxsize=200_000)
def estimate(m: GptModel, g: GpuType, x: int, model_parallel: int = 0) -> Estimate:
    """Best configuration of ``m`` on exactly ``x`` GPUs of type ``g``.

    Args:
        m: The model.
        g: The GPU type.
        x: GPUs.
        model_parallel: When set, only configurations with TP x PP equal to it
            (a task whose replica size is fixed); 0 lets TP and PP vary.

    Returns:
        The estimate; :data:`INFEASIBLE` when nothing fits.
    """
    if x < 1:
        return INFEASIBLE
    best = INFEASIBLE
    for tp, pp, dp, mb in _configs(m, g, x, model_parallel):
        for recompute in (False, True):
            c = ParallelConfig(tp, pp, dp, mb, recompute)
            mem = memory_per_gpu(m, c)
            if mem > 0.95 * g.memory_bytes:
                continue
            t = iteration_time(m, g, c)
            flops = m.flops_per_iteration / t
            if flops > best.flops:
                hw = flops * (4 / 3 if recompute else 1)
                best = Estimate(flops, c, t, hw, mem)
            break  # recomputation only when the plain configuration does not fit
    return best


@lru_cache(maxsize=4096)
def candidate_sizes(m: GptModel, g: GpuType, n: int) -> tuple[int, ...]:
    """Every x <= n at which ``m`` has a feasible configuration (ascending).

    T(t, x) is zero elsewhere, so the solver only needs these sizes.
    """
    sizes = set()
    for tp in _divisors(m.heads):
        if tp > g.gpus_per_node:
            continue
        for pp in _divisors(m.layers):
            for dp in _divisors(m.global_batch):
                x = tp * pp * dp
                if x <= n:
                    sizes.add(x)
    return tuple(x for x in sorted(sizes) if estimate(m, g, x).feasible)


#: Largest aggregate FLOP/s a calibration entry may claim (1e24: a zettaFLOP/s
#: times a thousand); larger values are typos that would overflow the cost model.
MAX_CALIBRATED_FLOPS = 1e24
#: Largest cluster the planner accepts, in GPUs (also the largest calibrated
#: size). The solver's DP holds a few float rows of n'+1 entries per task and
#: solves 100,000 GPUs in milliseconds; far larger n' would exhaust memory, so
#: it is refused at once.
MAX_GPUS = 100_000


def _calibration_entry(gpus: object, flops: object) -> tuple[int, float]:
    """Checked ``(gpus, flops)`` of one calibration entry.

    Raises:
        ConfigError: ``gpus`` is not an integer in 1..:data:`MAX_GPUS` or
            ``flops`` is not a finite number in 0..:data:`MAX_CALIBRATED_FLOPS`.
    """
    return (
        int(finite_positive("gpus", gpus, MAX_GPUS, integer=True)),
        float(finite_positive("flops", flops, MAX_CALIBRATED_FLOPS, allow_zero=True)),
    )


@dataclass
class ThroughputModel:
    """T(t, x) for tasks on one GPU type, with an optional calibration table.

    Args:
        gpu: The GPU type of the cluster.
        calibration: Measured FLOP/s by (model name, x); overrides the model.
            0 marks a size infeasible.

    Raises:
        ConfigError: A calibration entry has a non-finite or out-of-range value.
    """

    gpu: GpuType
    calibration: dict[tuple[str, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for (name, gpus), flops in self.calibration.items():
            try:
                _calibration_entry(gpus, flops)
            except ConfigError as exc:
                raise ConfigError(f"calibration of model {name!r} on {gpus!r} GPUs: {exc}") from None

    def flops(self, m: GptModel, x: int) -> float:
        """Achieved aggregate FLOP/s of ``m`` on ``x`` GPUs (0 if infeasible)."""
        measured = self.calibration.get((m.name, x))
        if measured is not None:
            return measured
        return estimate(m, self.gpu, x).flops

    def candidates(self, m: GptModel, n: int) -> tuple[int, ...]:
        """Sizes <= n where T > 0 (calibrated sizes included)."""
        sizes = set(candidate_sizes(m, self.gpu, n))
        for (name, x), value in self.calibration.items():
            if name == m.name and x <= n:
                if value > 0:
                    sizes.add(x)
                else:
                    sizes.discard(x)
        return tuple(sorted(sizes))

    @staticmethod
    def load_calibration(path: str | Path) -> dict[tuple[str, int], float]:
        """Read a calibration file: CSV with columns ``model,gpus,flops`` or JSON list of those.

        ``gpus`` must be an integer in 1..:data:`MAX_GPUS`, ``flops``
        a finite number in 0..:data:`MAX_CALIBRATED_FLOPS` (0: infeasible).

        Raises:
            ConfigError: The file is malformed, nested too deeply, or holds a
                non-finite or out-of-range number (message names file and row).
        """
        path = Path(path)
        try:
            if path.suffix == ".json":
                rows = json.loads(path.read_text())
            else:
                with path.open(newline="") as f:
                    rows = list(csv.DictReader(f))
            if not isinstance(rows, list):
                raise TypeError(f"expected a list of rows, got {type(rows).__name__}")
            table = {}
            for i, row in enumerate(rows):
                if not isinstance(row, dict):
                    raise TypeError(f"row {i}: expected an object, got {type(row).__name__}")
                try:
                    gpus, flops = _calibration_entry(row["gpus"], row["flops"])
                except ConfigError as exc:
                    raise ValueError(f"row {i}: {exc}") from None
                table[(str(row["model"]), gpus)] = flops
            return table
        except RecursionError:
            raise ConfigError(f"calibration file {path}: JSON nested too deeply") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"calibration file {path}: {exc}") from exc


@dataclass
class TabulatedThroughput:
    """T(t, x) given as a table per model name, zero elsewhere (the coordinator's node-unit model).

    Has the two methods the cost model calls, like :class:`ThroughputModel`.

    Args:
        table: FLOP/s by model name and size; sizes absent or at 0 are infeasible.
    """

    table: dict[str, dict[int, float]]

    def flops(self, m: GptModel, x: int) -> float:
        """T of ``m`` at ``x`` (0 if not tabulated)."""
        return self.table.get(m.name, {}).get(x, 0.0)

    def candidates(self, m: GptModel, n: int) -> tuple[int, ...]:
        """Tabulated sizes <= n where T > 0."""
        return tuple(sorted(x for x, v in self.table.get(m.name, {}).items() if v > 0 and x <= n))
