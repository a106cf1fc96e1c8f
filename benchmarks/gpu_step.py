"""GPU benchmark: canzona's optimizer step on one CUDA device, by Newton–Schulz method, against
torch.optim.Muon + fused AdamW and (where installed) gram_newton_schulz.Muon.

Run:  python benchmarks/gpu_step.py                 (qwen3-1.7b and qwen3-4b, optimizer steps, then
                                                     a transformers Qwen3ForCausalLM iteration)
      python benchmarks/gpu_step.py --models qwen3-1.7b --no-model
      python benchmarks/gpu_step.py --write BENCHMARKS.md

Without a CUDA device it says so and exits 0 (nothing is measured on CPU here: see
benchmarks/runtime_step.py and benchmarks/memory.py for the CPU figures).

Per model (world size 1, NCCL, TP 1 x DP 1, bf16 parameters and bf16 gradients of the preset's
shapes, transformers' names, Muon on the matrices and AdamW on the rest), in one process:

- `canzona standard`: `CanzonaOptimizer` with its defaults (the standard Newton–Schulz in bf16:
  `ns_dtype="auto"`);
- `canzona gram`: the same on a schedule planned with `--ns-method gram` (Gram Newton–Schulz,
  restart after 2; matrices at most twice as long as wide fall back; the `gram-newton-schulz`
  kernels where the package is installed, else canzona's torch form);
- `torch`: `torch.optim.Muon` (bf16 Newton–Schulz) on the matrices + `torch.optim.AdamW(fused=True)`
  on the rest, with the same learning rates;
- `gram_newton_schulz.Muon`: the package's own optimizer (Gram, its kernels, restart after 2,
  canzona's default coefficients) with a fused AdamW as its scalar optimizer, where installed;
- `NS floor standard` / `NS floor gram`: the Newton–Schulz products alone, in bf16, over the
  same matrices, stacked by shape (the kernel canzona runs:
  `canzona.runtime.rules.newton_schulz.orthogonalize_`).

Each is timed over warm steps (CUDA events, median), with the peak memory the step allocates
above the parameters and gradients (`torch.cuda.max_memory_allocated`), and the Newton–Schulz
rate in TFLOP/s (the planner's FLOPs of the method, `canzona.schedules.costs.ns_flops`, 5 steps,
over the step's time). Ratios are against torch, in the same run. `--model` adds a whole
iteration: a transformers `Qwen3ForCausalLM` of the first model's shape (bf16, 8 sequences of
2048 tokens), forward + backward + step, with canzona (standard) and torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_md import write_section

MODELS = ("qwen3-1.7b", "qwen3-4b")
WARMUP, STEPS = 3, 10
LR, ADAMW_LR = 0.02, 3e-4
RESTART = 2
SIMPLE = (3.4445, -4.7750, 2.0315)  # canzona's default ("simple") coefficients, every iteration
HEADING = "## GPU step (one device)"
GIB = 1 << 30


def _schedule(model: str, method: str = "standard") -> Any:
    """The TP 1 x DP 1 schedule of a preset with transformers' names and bf16 parameters, its
    Newton–Schulz by `method`."""
    from canzona.planner.compile import compile_schedule
    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.plan import PlanRequest, make_plan
    from canzona.planner.sources.load import load_model
    from canzona.planner.spec import ModelOptions

    options = ModelOptions(names="hf")
    spec = load_model(model, 1, options)
    spec = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, dtype="bf16") for p in spec.params))
    return compile_schedule(
        make_plan(spec, PlanRequest(model, 1, 1, optimizer=OptimizerConfig("muon", ns_method=method), options=options))
    )


def _params(schedule: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters of the schedule's shapes on the GPU, with random bf16 gradients."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for entry in sorted(schedule.params, key=lambda e: e.index):
        param = torch.nn.Parameter(
            torch.randn(entry.shape, generator=generator, device="cuda", dtype=torch.bfloat16) * 0.02
        )
        param.grad = torch.randn(entry.shape, generator=generator, device="cuda", dtype=torch.bfloat16)
        out.append((entry.name, param))
    return out


def ns_flops(shapes: list[tuple[int, int]], method: str = "standard", steps: int = 5) -> float:
    """Newton–Schulz FLOPs of one step over matrices of `shapes` by `method` (the planner's count)."""
    from canzona.schedules.costs import ns_flops as flops_of

    return sum(flops_of(rows, cols, steps, method, RESTART) for rows, cols in shapes)


def _timed(step: Callable[[], None]) -> tuple[float, float]:
    """(median seconds, peak bytes allocated above the memory in use before the first step)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for index in range(WARMUP + STEPS):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        torch.cuda.synchronize()
        if index >= WARMUP:
            times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def _canzona(params: list[tuple[str, Any]], schedule: Any) -> Any:
    import torch.distributed as dist

    from canzona.runtime import CanzonaOptimizer

    group = dist.group.WORLD
    return CanzonaOptimizer(params, schedule, dp_group=group, tp_group=group, lr=LR, adamw_lr=ADAMW_LR)


def _split(params: list[tuple[str, Any]]) -> tuple[list[Any], list[Any]]:
    """The matrices Muon updates (2-D, not the embedding or the output layer) and the rest."""
    matrices = [
        p
        for _, p in params
        if p.dim() == 2 and "embed" not in _name_of(params, p) and "lm_head" not in _name_of(params, p)
    ]
    return matrices, [p for _, p in params if all(p is not m for m in matrices)]


def _gram_package(params: list[tuple[str, Any]]) -> Callable[[], None]:
    """gram_newton_schulz.Muon (its kernels, restart after 2, canzona's coefficients) with a
    fused AdamW on the rest."""
    from gram_newton_schulz import Muon

    matrices, rest = _split(params)
    optimizer = Muon(
        matrices,
        lr=LR,
        weight_decay=0.0,
        ns_coefficients=[list(SIMPLE)] * 5,
        ns_algorithm="gram_newton_schulz",
        gram_newton_schulz_restart_iterations=[RESTART],
        scalar_optimizer=torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.0, fused=True),
    )
    return optimizer.step


def _torch_muon(params: list[tuple[str, Any]]) -> Callable[[], None]:
    matrices, rest = _split(params)
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=0.0)
    adamw = torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.0, fused=True)

    def step() -> None:
        muon.step()
        adamw.step()

    return step


def _name_of(params: list[tuple[str, Any]], tensor: Any) -> str:
    return next(name for name, p in params if p is tensor)


def _ns_floor(shapes: list[tuple[int, int]], method: str) -> Callable[[], None]:
    from canzona.runtime.rules.newton_schulz import orthogonalize_

    by_shape: dict[tuple[int, int], int] = {}
    for shape in shapes:
        by_shape[shape] = by_shape.get(shape, 0) + 1
    scratch = {shape: [torch.randn(shape, device="cuda") for _ in range(count)] for shape, count in by_shape.items()}

    def step() -> None:
        for matrices in scratch.values():
            orthogonalize_(matrices, 5, SIMPLE, "bf16", method=method, restart=RESTART)

    return step


VARIANTS = (
    "canzona standard",
    "canzona gram",
    "torch",
    "gram_newton_schulz.Muon",
    "NS floor standard",
    "NS floor gram",
)


def _gram_package_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("gram_newton_schulz") is not None


def _step_of(variant: str, params: list[tuple[str, Any]], schedules: dict[str, Any], shapes: Any) -> Any:
    """The step function of one variant (None: not available here)."""
    if variant.startswith("canzona"):
        return _canzona(params, schedules[variant.split()[1]]).step
    if variant == "torch":
        return _torch_muon(params)
    if variant == "gram_newton_schulz.Muon":
        return _gram_package(params) if _gram_package_installed() else None
    return _ns_floor(shapes, variant.split()[-1])


def measure(model: str) -> dict[str, Any]:
    """Step time, peak memory and NS rate of every variant (module docstring) on `model`."""
    schedules = {method: _schedule(model, method) for method in ("standard", "gram")}
    shapes = [tuple(e.shape) for e in schedules["standard"].params if e.optimizer == "matrix"]
    params_count = sum(e.numel for e in schedules["standard"].params)
    row: dict[str, Any] = {"model": model, "params": params_count}
    for variant in VARIANTS:
        params = _params(schedules["standard"]) if "floor" not in variant else []
        step = _step_of(variant, params, schedules, shapes)
        if step is None:
            row[variant] = None
            continue
        flops = ns_flops(shapes, "gram" if "gram" in variant else "standard")  # type: ignore[arg-type]
        try:
            seconds, peak = _timed(step)
            row[variant] = {"s": seconds, "peak": peak, "tflops": flops / seconds / 1e12}
        except torch.cuda.OutOfMemoryError:
            row[variant] = "out of memory"
        del params, step
        torch.cuda.empty_cache()
    return row


def measure_model(model: str, batch: int = 8, seq: int = 2048) -> dict[str, float]:
    """One transformers Qwen3ForCausalLM iteration (forward + backward + step) per optimizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from canzona.planner.sources.catalog import PRESETS

    arch = PRESETS[model]
    config = Qwen3Config(
        hidden_size=arch.h,
        intermediate_size=arch.ffn,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_groups,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab,
        tie_word_embeddings=arch.tied_embeddings,
    )
    schedule = _schedule(model)
    tokens = torch.randint(0, arch.vocab, (batch, seq), device="cuda")
    out = {}
    for name in ("canzona", "torch"):
        net = Qwen3ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
        named = list(net.named_parameters())
        step = _canzona(named, schedule).step if name == "canzona" else _torch_muon(named)

        def iteration(net: Any = net, step: Any = step) -> None:
            net(input_ids=tokens, labels=tokens).loss.backward()
            step()
            net.zero_grad(set_to_none=True)

        out[name] = _timed(iteration)[0]
        del net, named, step
        torch.cuda.empty_cache()
    return out


def table(rows: list[dict[str, Any]], iteration: dict[str, float] | None, device: str) -> str:
    """The markdown table of the run: one row per model and variant, ratios against torch."""
    lines = [
        f"Device: {device}. One process, NCCL world size 1, TP 1 x DP 1, bf16 parameters and gradients; "
        f"median of {STEPS} steps after {WARMUP}; peak = memory the step allocates above params + grads.",
        "",
        "| model | params | variant | step s | step / torch | peak GiB (B/param) | peak / torch | NS TFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        torch_row = row["torch"] if isinstance(row["torch"], dict) else None
        for variant in VARIANTS:
            got = row[variant]
            head = f"| {row['model']} | {row['params'] / 1e9:.2f}B | {variant} |"
            if not isinstance(got, dict):
                lines.append(f"{head} {got or 'not installed'} | - | - | - | - |")
                continue
            versus = (
                (f"{got['s'] / torch_row['s']:.2f}x", f"{got['peak'] / max(torch_row['peak'], 1):.2f}x")
                if torch_row and "floor" not in variant
                else ("-", "-")
            )
            lines.append(
                f"{head} {got['s']:.4f} | {versus[0]} | {got['peak'] / GIB:.2f} ({got['peak'] / row['params']:.1f}) "
                f"| {versus[1]} | {got['tflops']:.0f} |"
            )
    if iteration:
        lines += [
            "",
            f"Whole iteration (transformers Qwen3ForCausalLM of {rows[0]['model']}'s shape, bf16, 8 x 2048 "
            f"tokens): canzona {iteration['canzona']:.3f} s, torch {iteration['torch']:.3f} s, ratio "
            f"{iteration['canzona'] / iteration['torch']:.2f}x.",
        ]
    return "\n".join(lines)


def main() -> None:
    """Measure every model (and the iteration) on the GPU; print (optionally write) the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-model", action="store_true", help="skip the transformers iteration")
    parser.add_argument("--write", type=Path, help="update this BENCHMARKS.md (only if it exists)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step: no CUDA device here; nothing measured (run it on a GPU machine)")
        return
    import os
    import tempfile

    import torch.distributed as dist

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        rows = [measure(model) for model in args.models.split(",") if model]
        iteration = None if args.no_model else measure_model(rows[0]["model"])
        dist.destroy_process_group()
    text = table(rows, iteration, torch.cuda.get_device_name(0))
    print(text)
    if args.write is not None and args.write.exists():
        write_section(args.write, HEADING, text, "python benchmarks/gpu_step.py")


if __name__ == "__main__":
    sys.exit(main())
