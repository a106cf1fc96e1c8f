"""Time the real optimizer kernels with torch on this device: the measurements behind the
planner's `profile:` cost model (docs/concepts.md, cost models).

Each matrix row times the runtime's own `matrix_update` (momentum + Newton–Schulz for Muon, its
products in the precision the runtime uses by default on the device, `ns_dtype="auto"`: bf16 on
CUDA, fp32 elsewhere, which the profile records as its `dtype`;
statistics, inverse roots and preconditioning for Shampoo; statistics, eigenbasis refresh and
projections for SOAP) on a random fp32 gradient, after warm-up, as the median of several
repeats (`torch.cuda.synchronize` around each on a GPU). Shampoo and SOAP are timed on a step
that refreshes the preconditioner and on one that does not, and the row's `seconds` is the
per-step cost amortised over `precondition_frequency`. AdamW rows time `adamw_` on vectors.
Optionally, gloo collectives between local processes are timed and fitted to α–β, the
slowdown of a kernel run by several processes at once is measured (ranks sharing cores), and
training throughput is measured: forward and backward of one matmul per shape on a number of
tokens, as model FLOPs (6 · elements · tokens) per second.

Returns a plain dict in the profile format (`canzona-profile/1`); the CLI validates and writes
it with the planner's `Profile` model (the runtime never imports the planner).
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from canzona.runtime.rules.newton_schulz import resolve_ns_dtype
from canzona.runtime.rules.optimizers import (
    Hyperparameters,
    adamw_,
    init_matrix_state,
    make_rule,
    matrix_update,
)
from canzona.schedules.costs import methods_run
from canzona.schedules.limits import DEFAULT_GRAM_RESTART, STANDARD_NS

PROFILE_FORMAT = "canzona-profile/1"
MATRIX_OPTIMIZERS = ("muon", "shampoo", "soap")
DEFAULT_ADAMW_SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
DEFAULT_COMM_SIZES = (1 << 8, 1 << 12, 1 << 16, 1 << 20, 1 << 22)  # fp32 elements sent to each peer


@dataclass(frozen=True)
class Settings:
    """Optimizer settings the kernels run with (the planner's `OptimizerConfig` fields)."""

    ns_steps: int = 5
    block_size: int = 1024
    precondition_frequency: int = 10
    max_precond_dim: int = 10000
    ns_dtype: str = "auto"
    gram_restart: int = DEFAULT_GRAM_RESTART


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of `fn` over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _hyperparameters(settings: Settings, method: str = STANDARD_NS) -> Hyperparameters:
    return Hyperparameters(
        ns_steps=settings.ns_steps,
        block_size=settings.block_size,
        precondition_frequency=settings.precondition_frequency,
        max_precond_dim=settings.max_precond_dim,
        ns_dtype=settings.ns_dtype,
        ns_method=method,
        gram_restart=settings.gram_restart,
    )


def matrix_row(
    optimizer: str,
    rows: int,
    cols: int,
    settings: Settings,
    device: torch.device,
    warmup: int,
    repeats: int,
    method: str = STANDARD_NS,
) -> dict[str, Any]:
    """One profile row: the per-step seconds of `optimizer` on a rows x cols matrix (Muon: by
    Newton–Schulz `method`, which a gram row records)."""
    rule = make_rule(optimizer, _hyperparameters(settings, method))
    with torch.device(device):
        states = init_matrix_state(rule, (rows, cols), None, device)
        grad = torch.randn(rows, cols)
    refresh = median_seconds(lambda: matrix_update(rule, states, grad, None, 1), device, warmup, repeats)
    if optimizer == "muon":
        row = {"optimizer": optimizer, "rows": rows, "cols": cols, "seconds": refresh, "repeats": repeats}
        return row if method == STANDARD_NS else {"optimizer": optimizer, "method": method, **row}
    # Step 2 refreshes nothing when the frequency is above 1 (step 1 built SOAP's basis).
    plain = median_seconds(lambda: matrix_update(rule, states, grad, None, 2), device, warmup, repeats)
    frequency = settings.precondition_frequency
    amortised = refresh if frequency == 1 else plain + max(refresh - plain, 0.0) / frequency
    return {
        "optimizer": optimizer,
        "rows": rows,
        "cols": cols,
        "seconds": amortised,
        "repeats": repeats,
        "step_seconds": plain,
        "refresh_seconds": refresh,
    }


def adamw_row(numel: int, device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """One profile row: seconds of one AdamW step on `numel` fp32 elements."""
    hp = Hyperparameters()
    with torch.device(device):
        param, grad, exp_avg, exp_avg_sq = (torch.randn(numel) for _ in range(4))
    exp_avg_sq.abs_()
    seconds = median_seconds(lambda: adamw_(param, grad, exp_avg, exp_avg_sq, 1, hp), device, warmup, repeats)
    return {"optimizer": "adamw", "rows": numel, "cols": 1, "seconds": seconds, "repeats": repeats}


def training_fit(
    shapes: Sequence[tuple[int, int]], tokens: int, device: torch.device, warmup: int, repeats: int
) -> dict[str, Any]:
    """Achieved training FLOP/s: for each rows x cols weight, forward y = x·Wᵀ on `tokens` rows
    and its backward (input and weight gradients), timed together; 6·rows·cols·tokens FLOPs."""
    if tokens < 1 or not shapes:
        raise ValueError("training calibration needs tokens >= 1 and at least one shape")
    flops = seconds = 0.0
    for rows, cols in shapes:
        with torch.device(device):
            weight = torch.randn(rows, cols, requires_grad=True)
            inputs = torch.randn(tokens, cols, requires_grad=True)
            upstream = torch.randn(tokens, rows)
        seconds += median_seconds(_forward_backward(weight, inputs, upstream), device, warmup, repeats)
        flops += 6.0 * rows * cols * tokens
    return {"tokens": tokens, "shapes": len(shapes), "flops_per_second": flops / seconds}


def _forward_backward(weight: torch.Tensor, inputs: torch.Tensor, upstream: torch.Tensor) -> Callable[[], None]:
    """y = x·Wᵀ and its backward from `upstream`, the gradients cleared first (so every call
    does the same work)."""

    def run() -> None:
        weight.grad, inputs.grad = None, None
        (inputs @ weight.t()).backward(upstream)

    return run


def device_name(device: torch.device) -> str:
    """A readable name of the device (GPU model, or the CPU's model name)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def calibrate(
    shapes: Sequence[tuple[int, int]],
    settings: Settings = Settings(),
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    optimizers: Sequence[str] | Mapping[str, Sequence[tuple[int, int]]] = MATRIX_OPTIMIZERS,
    adamw_sizes: Sequence[int] = DEFAULT_ADAMW_SIZES,
    threads: int | None = None,
    comm_ranks: int = 0,
    progress: Callable[[str], None] | None = None,
    train_shapes: Sequence[tuple[int, int]] = (),
    train_tokens: int = 0,
) -> dict[str, Any]:
    """Time every (optimizer, shape) and AdamW size on `device`; returns the profile dict.

    `optimizers` names the optimizers timed on every shape, or maps names to their own shapes
    (to time some optimizers on fewer shapes). `threads` sets torch's CPU threads (default: torch's).
    `comm_ranks` >= 2 also fits gloo collectives between that many local processes and, on a
    CPU, measures how much slower kernels run with that many (and twice as many) processes.
    `train_tokens` >= 1 also measures training throughput on `train_shapes` (`training_fit`)."""
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no GPU")
    if threads is not None:
        torch.set_num_threads(threads)
    plan = dict(optimizers) if isinstance(optimizers, Mapping) else {name: list(shapes) for name in optimizers}
    rows = []
    for name, todo in plan.items():
        if name not in MATRIX_OPTIMIZERS:
            raise ValueError(f"unknown matrix optimizer {name!r}; expected one of {', '.join(MATRIX_OPTIMIZERS)}")
        for r, c in dict.fromkeys((int(a), int(b)) for a, b in todo):
            for method in methods_run(name, r, c):
                rows.append(matrix_row(name, r, c, settings, target, warmup, repeats, method))
                if progress:
                    label = name if method == STANDARD_NS else f"{name} {method}"
                    progress(f"{label} {r}x{c}: {rows[-1]['seconds'] * 1e3:.3f} ms")
    for numel in adamw_sizes:
        rows.append(adamw_row(int(numel), target, warmup, repeats))
        if progress:
            progress(f"adamw {numel}: {rows[-1]['seconds'] * 1e3:.3f} ms")
    profile: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "device": target.type,
        "device_name": device_name(target),
        "torch": torch.__version__,
        "dtype": resolve_ns_dtype(settings.ns_dtype, target),
        "threads": torch.get_num_threads(),
        "settings": {k: v for k, v in asdict(settings).items() if k != "ns_dtype"},
        "rows": rows,
    }
    if train_tokens >= 1:
        profile["training"] = training_fit(train_shapes, train_tokens, target, warmup, repeats)
        if progress:
            progress(f"training: {profile['training']['flops_per_second'] / 1e9:.3g} GFLOP/s on {train_tokens} tokens")
    if comm_ranks >= 2:
        profile["comm"] = fit_collectives(comm_ranks, repeats=repeats)
        if target.type == "cpu":
            profile["contention"] = measure_contention(sorted({comm_ranks, 2 * comm_ranks}), repeats=repeats)
    return profile


# --------------------------------------------------------------------------------------------
# Processes sharing the host


def _contention_worker(
    shape: tuple[int, int], settings: Settings, warmup: int, repeats: int, start: Any, out: Any
) -> None:
    torch.set_num_threads(1)
    start.wait()
    out.put(matrix_row("muon", shape[0], shape[1], settings, torch.device("cpu"), warmup, repeats)["seconds"])


def measure_contention(
    process_counts: Sequence[int] = (2, 4),
    shape: tuple[int, int] = (512, 512),
    settings: Settings = Settings(),
    warmup: int = 1,
    repeats: int = 5,
) -> list[dict[str, Any]]:
    """How much slower a single-threaded Muon kernel runs when `n` processes run it at once
    (the median process's time over the time alone): what ranks sharing a host's cores pay."""

    def run(count: int) -> float:
        context = mp.get_context("fork")
        start, out = context.Barrier(count), context.Queue()
        workers = [
            context.Process(target=_contention_worker, args=(shape, settings, warmup, repeats, start, out))
            for _ in range(count)
        ]
        for worker in workers:
            worker.start()
        times = [out.get(timeout=600) for _ in workers]
        for worker in workers:
            worker.join()
        return statistics.median(times)

    alone = run(1)
    return [{"processes": count, "slowdown": max(1.0, run(count) / alone)} for count in process_counts]


# --------------------------------------------------------------------------------------------
# gloo collectives between local processes


def _comm_worker(rank: int, world: int, init_file: str, sizes: Sequence[int], repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results = []
    for size in sizes:
        send, received = torch.randn(size * world, device="cpu"), torch.empty(size * world, device="cpu")
        calls = max(1, min(50, (1 << 22) // max(size, 1)))  # enough calls that small sizes are measurable
        for _ in range(3):
            dist.all_to_all_single(received, send)
        times = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(calls):
                dist.all_to_all_single(received, send)
            elapsed = torch.tensor([(time.perf_counter() - started) / calls], device="cpu")
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
        results.append(statistics.median(times))
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def fit_collectives(ranks: int = 2, sizes: Sequence[int] = DEFAULT_COMM_SIZES, repeats: int = 5) -> dict[str, Any]:
    """α–β fit of gloo all-to-all among `ranks` local processes: each rank sends `size` fp32
    elements to every peer; seconds = (n − 1)·α + bytes sent per rank / bandwidth."""
    context = mp.get_context("fork")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        workers = [
            context.Process(target=_comm_worker, args=(r, ranks, init_file, sizes, repeats, queue))
            for r in range(ranks)
        ]
        for worker in workers:
            worker.start()
        seconds = queue.get(timeout=600)
        for worker in workers:
            worker.join()
    return fit_alpha_beta([4.0 * size * (ranks - 1) for size in sizes], seconds, ranks)


def fit_alpha_beta(volumes: Sequence[float], seconds: Sequence[float], ranks: int) -> dict[str, Any]:
    """α from the smallest exchange (latency-bound); bandwidth from the slope between the two
    largest (bandwidth-bound), so neither end swamps the other."""
    order = sorted(range(len(volumes)), key=volumes.__getitem__)
    latency = seconds[order[0]] / (ranks - 1)
    if len(order) >= 3:
        low, high = order[-2], order[-1]
        rise = seconds[high] - seconds[low]
        bandwidth = (volumes[high] - volumes[low]) / rise if rise > 0 else volumes[high] / seconds[high]
    else:
        transfer = seconds[order[-1]] - (ranks - 1) * latency
        bandwidth = volumes[order[-1]] / (transfer if transfer > 0 else seconds[order[-1]])
    return {"backend": "gloo", "ranks": ranks, "latency": latency, "bandwidth": bandwidth}
