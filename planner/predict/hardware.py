"""Hardware models for the step-time simulator: device throughput and network.

A `Hardware` is a frozen description of one device type and its network: achieved FLOP/s of
the matrix optimizer's work, achieved memory bandwidth (AdamW is memory-bound), the α of the
α–β collective model, per-device bandwidth inside a node and across nodes, and GPUs per node.
Every built-in model says where its numbers come from (`source`). A `Device` pairs a hardware
model with an optional measured profile, which then prices compute instead of throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import canzona.schedules
from canzona.planner.partition.collectives import (
    FP32_SHARE,
    NS_BF16_FLOPS,
    REFERENCE_NETWORK,
    TF32_SHARE,
    Network,
)
from canzona.planner.partition.costs import CostModel, FlopsCost, OptimizerConfig
from canzona.planner.partition.profile_cost import Profile, ProfileCost, read_profile
from canzona.planner.spec import PlanError
from canzona.schedules.costs import update_precision
from canzona.schedules.limits import PROFILE_PREFIX

ADAMW_BYTES_PER_ELEMENT = 28  # fp32 param, grad, m, v read (16) and param, m, v written (12)
GB = 1e9
CPU_PROFILE = Path(canzona.schedules.__file__).resolve().parent / "profiles" / "cpu-dev.yaml"
CPU_GPUS_PER_NODE = 1 << 20  # every rank of a CPU run is on this one host


@dataclass(frozen=True)
class Hardware:
    """One device type and its network. Rates are per device; bandwidths per direction
    (links are full duplex). `latency` is seconds per collective step (one ring step or one
    pairwise exchange round). `matrix_flops` is the rate of bf16 products; `fp32_share` and
    `tf32_share` scale it for fp32 and TF32 ones (1: one measured rate for every precision, as
    a profile has). `train_flops`: achieved model FLOP/s of training forward and backward
    (6·N·tokens convention); None: not known, the matrix optimizer's rate stands in."""

    name: str
    matrix_flops: float
    memory_bandwidth: float
    latency: float
    intra_bandwidth: float
    inter_bandwidth: float
    gpus_per_node: int
    source: str
    train_flops: float | None = None
    fp32_share: float = 1.0
    tf32_share: float = 1.0
    gpu: bool = True

    def __post_init__(self) -> None:
        for key in ("matrix_flops", "memory_bandwidth", "intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, key) > 0:
                raise PlanError(f"hardware {self.name!r}: {key} must be > 0")
        if self.train_flops is not None and not self.train_flops > 0:
            raise PlanError(f"hardware {self.name!r}: train_flops must be > 0")
        if self.latency < 0:
            raise PlanError(f"hardware {self.name!r}: latency must be >= 0")
        if self.gpus_per_node < 1:
            raise PlanError(f"hardware {self.name!r}: gpus per node must be >= 1")

    def rate(self, precision: str) -> float:
        """Achieved matrix FLOP/s of products in `precision` (bf16, tf32, fp32)."""
        return self.matrix_flops * {"bf16": 1.0, "tf32": self.tf32_share, "fp32": self.fp32_share}[precision]

    def training_flops(self) -> float:
        """Achieved FLOP/s of training forward and backward (the matrix rate if unknown)."""
        return self.train_flops if self.train_flops is not None else self.matrix_flops

    @property
    def network(self) -> Network:
        """The network figures of this model, as the α–β collectives take them."""
        return Network(self.latency, self.intra_bandwidth, self.inter_bandwidth, self.gpus_per_node)


@dataclass(frozen=True)
class ThroughputCost:
    """`CostModel` in seconds from a hardware model: flops-model FLOPs (of the configured
    Newton–Schulz method) / achieved FLOP/s in the precision the runtime's products run in
    (`update_precision`: Muon's `ns_dtype`, fp32 for Shampoo and SOAP) for matrices, bytes
    moved / achieved bandwidth for AdamW."""

    hardware: Hardware
    optimizer: OptimizerConfig
    name: str = "throughput"

    @property
    def precision(self) -> str:
        """The precision the matrix updates are priced at."""
        return update_precision(self.optimizer, self.hardware.gpu)

    def matrix_cost(self, rows: int, cols: int) -> float:
        """Seconds of one update of a full rows x cols matrix."""
        return FlopsCost(self.optimizer).matrix_cost(rows, cols) / self.hardware.rate(self.precision)

    def adamw_cost(self, numel: int) -> float:
        """Seconds of an AdamW update of `numel` elements."""
        return ADAMW_BYTES_PER_ELEMENT * numel / self.hardware.memory_bandwidth


NS_BF16_SHARE = NS_BF16_FLOPS / 989e12  # of the H200's dense BF16 peak
_NS = (
    "575 TFLOP/s, the runtime's default bf16 Newton-Schulz (bf16 operands, fp32 accumulation, fused "
    "baddbmm form) measured on one H200 over qwen3-1.7b's matrices (586 TFLOP/s stacked by shape; 58% of peak)"
)
_PRECISIONS = (
    "fp32 products (Shampoo, SOAP, Muon with ns_dtype fp32) at 48 TFLOP/s, measured on the H200 with ns_dtype "
    "fp32; TF32 products at 58% of the 494.7 TFLOP/s dense TF32 peak (assumed, not measured)"
)
_NCCL = "NCCL α ≈ 5 µs per ring step (order of magnitude of published NCCL latencies)"
TRAIN_MFU = 0.4
_TRAIN = (
    "training forward/backward at 40% of dense BF16 peak (model FLOPs utilisation: Megatron-Core "
    "reports up to 47% MFU on H100; the Llama 3 paper reports 38-43% BF16 MFU on 8K-16K H100s)"
)

BUILTIN: dict[str, Hardware] = {
    "h100": Hardware(
        name="h100",
        matrix_flops=NS_BF16_FLOPS,
        memory_bandwidth=0.9 * 3.35e12,
        latency=REFERENCE_NETWORK.latency,  # the network the planner chooses collectives on
        intra_bandwidth=REFERENCE_NETWORK.intra_bandwidth,
        inter_bandwidth=REFERENCE_NETWORK.inter_bandwidth,
        gpus_per_node=REFERENCE_NETWORK.gpus_per_node,
        source=(
            f"matrix optimizer at {_NS}; {_PRECISIONS}; the H100 SXM5 has the H200's tensor cores and clocks "
            "(989 TFLOP/s dense BF16 on both datasheets), so the H200's measured rates are assumed; HBM3 3.35 TB/s "
            "at 90%; "
            "NVLink 4 900 GB/s bidirectional = 450 GB/s per direction; "
            f"InfiniBand NDR 400 Gb/s per GPU = 50 GB/s; 8 GPUs per node; {_NCCL}; {_TRAIN}"
        ),
        train_flops=TRAIN_MFU * 989e12,
        fp32_share=FP32_SHARE,
        tf32_share=TF32_SHARE,
    ),
    "h200": Hardware(
        name="h200",
        matrix_flops=NS_BF16_FLOPS,
        memory_bandwidth=0.9 * 4.8e12,
        latency=REFERENCE_NETWORK.latency,  # the network the planner chooses collectives on
        intra_bandwidth=REFERENCE_NETWORK.intra_bandwidth,
        inter_bandwidth=REFERENCE_NETWORK.inter_bandwidth,
        gpus_per_node=REFERENCE_NETWORK.gpus_per_node,
        source=(
            f"matrix optimizer at {_NS} (of the datasheet's 989 TFLOP/s dense BF16); {_PRECISIONS}; "
            "HBM3e 4.8 TB/s at 90%; "
            "NVLink 4 450 GB/s per direction; "
            f"InfiniBand NDR 400 Gb/s per GPU = 50 GB/s; 8 GPUs per node; {_NCCL}; {_TRAIN}"
        ),
        train_flops=TRAIN_MFU * 989e12,
        fp32_share=FP32_SHARE,
        tf32_share=TF32_SHARE,
    ),
    "a100": Hardware(
        name="a100",
        matrix_flops=NS_BF16_SHARE * 312e12,
        memory_bandwidth=0.9 * 2.039e12,
        latency=5e-6,
        intra_bandwidth=300 * GB,
        inter_bandwidth=25 * GB,
        gpus_per_node=8,
        source=(
            "NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense BF16, of which the runtime's bf16 "
            "Newton-Schulz is assumed to reach the share measured on the H200 (58%, not measured on an A100), "
            "fp32 products 72% of its 19.5 TFLOP/s FP32 and TF32 58% of its 156 TFLOP/s (the H200's shares); "
            "HBM2e 2.04 TB/s at 90%; NVLink 3 600 GB/s bidirectional = 300 GB/s per direction; "
            f"InfiniBand HDR 200 Gb/s per GPU = 25 GB/s; 8 GPUs per node; {_NCCL}; training "
            "forward/backward at 40% of dense BF16 peak, as for H100 (Megatron-LM on A100 reported 52% "
            "hardware FLOPs utilisation including activation recomputation)"
        ),
        train_flops=TRAIN_MFU * 312e12,
        fp32_share=0.72 * 19.5e12 / (NS_BF16_SHARE * 312e12),
        tf32_share=0.58 * 156e12 / (NS_BF16_SHARE * 312e12),
    ),
}
DEVICE_NAMES = (*BUILTIN, "cpu")


@dataclass(frozen=True)
class ScaledCost:
    """Another seconds cost model, every time multiplied by `factor` (ranks sharing cores)."""

    base: CostModel
    factor: float
    name: str = "scaled"

    def matrix_cost(self, rows: int, cols: int) -> float:
        """The base model's seconds times the factor."""
        return self.base.matrix_cost(rows, cols) * self.factor

    def adamw_cost(self, numel: int) -> float:
        """The base model's seconds times the factor."""
        return self.base.adamw_cost(numel) * self.factor


@dataclass(frozen=True)
class Device:
    """A hardware model, and the measured profile that prices compute when there is one.
    `slowdown` multiplies compute times (the profile's rows were timed on an idle core)."""

    hardware: Hardware
    profile: Profile | None = None
    slowdown: float = 1.0

    def time_model(self, optimizer: OptimizerConfig) -> CostModel:
        """The seconds cost model for `optimizer` on this device."""
        model: CostModel = ThroughputCost(self.hardware, optimizer)
        if self.profile is not None and optimizer.name in self.profile.optimizers():
            model = ProfileCost(self.profile, optimizer)
            if self.slowdown != 1.0:
                model = ScaledCost(model, self.slowdown, f"profile x {self.slowdown:.2f}")
        return model


def shared_host(device: Device, ranks: int) -> Device:
    """`device` for `ranks` processes sharing one host: compute (and loopback bandwidth, which
    is memory copies) slowed by the profile's measured contention at that many processes."""
    factor = device.profile.slowdown(ranks) if device.profile is not None else 1.0
    if factor == 1.0:
        return device
    hw = device.hardware
    scaled = replace(
        hw,
        matrix_flops=hw.matrix_flops / factor,
        memory_bandwidth=hw.memory_bandwidth / factor,
        train_flops=hw.train_flops / factor if hw.train_flops is not None else None,
        source=f"{hw.source}; {ranks} ranks sharing the host: compute x {factor:.2f} slower (measured)",
    )
    return Device(scaled, device.profile, device.slowdown * factor)


def hardware_from_profile(profile: Profile, name: str, source: str, compute_share: float = 1.0) -> Hardware:
    """A hardware model summarising a profile: median achieved FLOP/s of its first matrix
    optimizer, AdamW bandwidth, and its collective fit (or 1 GB/s, 50 µs without one). Every
    rank of a CPU run is on one host. `compute_share` scales compute (ranks sharing cores)."""
    names = profile.optimizers()
    if not names:
        raise PlanError(f"profile {name!r} has no matrix-optimizer rows")
    settings = profile.settings
    cost = ProfileCost(
        profile,
        OptimizerConfig(
            names[0],
            settings.ns_steps,
            settings.block_size,
            settings.precondition_frequency,
            settings.max_precond_dim,
            gram_restart=settings.gram_restart,
        ),
    )
    comm = profile.comm
    training = profile.training
    return Hardware(
        name=name,
        matrix_flops=cost.achieved_flops() * compute_share,
        memory_bandwidth=cost.achieved_adamw_rate() * ADAMW_BYTES_PER_ELEMENT * compute_share,
        latency=comm.latency if comm else 50e-6,
        intra_bandwidth=comm.bandwidth if comm else 1 * GB,
        inter_bandwidth=comm.bandwidth if comm else 1 * GB,
        gpus_per_node=CPU_GPUS_PER_NODE,
        gpu=profile.device == "cuda",  # the profile's rows are timed at its own precision: one rate for all
        source=source,
        train_flops=training.flops_per_second * compute_share if training else None,
    )


def profile_device(path: str | Path, name: str | None = None) -> Device:
    """A device from a profile file: compute from its rows, network from its fit."""
    profile = read_profile(path)
    label = name or Path(path).stem
    source = (
        f"measured by `canzona calibrate` on {profile.device_name} ({profile.device}, torch {profile.torch}, "
        f"{profile.threads} threads): {path}"
        + (f"; {profile.comm.backend} collectives fitted on {profile.comm.ranks} ranks" if profile.comm else "")
        + (
            f"; training forward/backward timed on {profile.training.tokens} tokens"
            if profile.training
            else "; no training calibration: forward/backward at the matrix optimizer's rate"
        )
    )
    return Device(hardware_from_profile(profile, label, source), profile)


def resolve_device(
    spec: str,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    gpus_per_node: int | None = None,
    latency_us: float | None = None,
) -> Device:
    """A built-in device (h100, h200, a100, cpu) or a profile file (`profile:FILE`, as the CLI
    spells it, or a bare path), with optional network overrides (GB/s per direction per device,
    microseconds per collective step)."""
    key = spec.strip().lower()
    if key in BUILTIN:
        device = Device(BUILTIN[key])
    elif key == "cpu":
        device = profile_device(CPU_PROFILE, "cpu")
    elif spec.startswith(PROFILE_PREFIX):
        device = profile_device(spec.removeprefix(PROFILE_PREFIX))
    elif Path(spec).suffix.lower() in (".yaml", ".yml") or Path(spec).exists():
        device = profile_device(spec)
    else:
        raise PlanError(f"unknown device {spec!r}; choose one of {', '.join(DEVICE_NAMES)} or give a profile file")
    return Device(override_network(device.hardware, intra_gbps, inter_gbps, gpus_per_node, latency_us), device.profile)


def override_network(
    hardware: Hardware,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    gpus_per_node: int | None = None,
    latency_us: float | None = None,
) -> Hardware:
    """`hardware` with the given network figures replaced (None keeps the model's)."""
    intra = hardware.intra_bandwidth if intra_gbps is None else intra_gbps * GB
    inter = hardware.inter_bandwidth if inter_gbps is None else inter_gbps * GB
    per_node = hardware.gpus_per_node if gpus_per_node is None else gpus_per_node
    latency = hardware.latency if latency_us is None else latency_us * 1e-6
    changes = {
        key: value
        for key, value, given in (
            ("intra_bandwidth", intra, intra_gbps),
            ("inter_bandwidth", inter, inter_gbps),
            ("gpus_per_node", per_node, gpus_per_node),
            ("latency", latency, latency_us),
        )
        if given is not None
    }
    if not changes:
        return hardware
    note = ", ".join(f"{key}={value:g}" for key, value in changes.items())
    return replace(
        hardware,
        intra_bandwidth=intra,
        inter_bandwidth=inter,
        gpus_per_node=per_node,
        latency=latency,
        source=f"{hardware.source}; overridden: {note}",
    )
