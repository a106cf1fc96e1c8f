"""Newton–Schulz by method on the CPU: FLOPs and time of the standard and the Gram iteration over
the matrix shapes of the schedule library.

Run:  python benchmarks/ns_methods.py                  (about a minute on 2 cores)
      python benchmarks/ns_methods.py --max-side 1024  (larger timed shapes, slower)

For every distinct Muon submatrix shape of the library's models (`schedules/`: the full,
unsharded shapes the planner prices) it prints the dense-GEMM FLOPs of 5 iterations by method
(`canzona.schedules.costs.ns_flops`, what the planner and the simulator price; the Gram
iteration with one restart after 2, a shape at most twice as long as wide falling back to the
standard one) and their ratio, then the model totals weighted by how many matrices of each shape
the model has. It times both methods (`orthogonalize_`, the runtime's kernel, fp32 products, the
CPU's default) on each shape scaled down to at most `--max-side` on a side, aspect kept, as
`canzona calibrate --quick` does: median of `--repeats` after one warm-up, in the same run, so
the ratio compares like with like. A CPU is not a GPU: the times say how the torch form behaves
here, not what the GPU kernels do (`benchmarks/gpu_step.py`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

from canzona.planner.sources.load import load_model
from canzona.planner.spec import MATRIX
from canzona.runtime.rules.newton_schulz import orthogonalize_
from canzona.schedules.costs import ns_flops, runs_gram
from canzona.schedules.format import read_schedule
from canzona.schedules.library import library_names, library_root

STEPS, RESTART = 5, 2
METHODS = ("standard", "gram")


def library_shapes() -> dict[str, Counter[tuple[int, int]]]:
    """Per library model, how many Muon submatrices of each (short side, long side) it has."""
    out: dict[str, Counter[tuple[int, int]]] = {}
    for name in library_names():
        model = read_schedule(library_root() / f"{name}.yaml").request.model.name
        if model in out:
            continue
        spec = load_model(model, 1)
        out[model] = Counter(
            (min(r, c), max(r, c)) for p in spec.params if p.optimizer == MATRIX for r, c in p.submatrices
        )
    return out


def scaled(shape: tuple[int, int], max_side: int) -> tuple[int, int]:
    """`shape` scaled down, aspect kept, to at most `max_side` on its long side."""
    factor = min(1.0, max_side / shape[1])
    return max(1, round(shape[0] * factor)), max(1, round(shape[1] * factor))


def time_method(shape: tuple[int, int], method: str, repeats: int) -> float:
    """Median seconds of one `orthogonalize_` of a matrix of `shape` by `method` (fp32)."""
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    times = []
    for attempt in range(repeats + 1):
        work = [grad.clone()]
        started = time.perf_counter()
        orthogonalize_(work, STEPS, "simple", "fp32", method=method, restart=RESTART)
        if attempt:  # the first is the warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    """Print the per-shape table and the per-model totals."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-side", type=int, default=512, help="longest timed side (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method and shape (default 5)")
    args = parser.parse_args()
    models = library_shapes()
    shapes = sorted({shape for counts in models.values() for shape in counts})
    print("# Newton-Schulz by method: FLOPs (full shapes) and CPU time (scaled shapes)\n")
    print(f"command: python benchmarks/ns_methods.py --max-side {args.max_side} --repeats {args.repeats}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {STEPS} steps, Gram restart after {RESTART}\n"
    )
    print(
        "| shape | long/short | gram runs | GFLOP standard | GFLOP gram | gram/standard | timed shape "
        "| ms standard | ms gram | gram/standard |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    timed: dict[tuple[tuple[int, int], str], float] = {}
    for shape in shapes:
        flops = [ns_flops(*shape, STEPS, method, RESTART) for method in METHODS]
        gram = runs_gram(*shape, "gram")
        small = scaled(shape, args.max_side)
        for method in METHODS[: 1 + gram]:  # a shape that falls back runs the standard products: timed once
            if (small, method) not in timed:
                timed[(small, method)] = time_method(small, method, args.repeats)
        standard = timed[(small, "standard")]
        times = f"{timed[(small, 'gram')] * 1e3:.2f} | {timed[(small, 'gram')] / standard:.2f}" if gram else "- | -"
        print(
            f"| {shape[0]}x{shape[1]} | {shape[1] / shape[0]:.2f} | {'yes' if gram else 'no'} "
            f"| {flops[0] / 1e9:.1f} | {flops[1] / 1e9:.1f} | {flops[1] / flops[0]:.3f} | {small[0]}x{small[1]} "
            f"| {standard * 1e3:.2f} | {times} |"
        )
    print("\n| model | matrices | gram runs on | TFLOP standard | TFLOP gram | gram/standard |")
    print("|---|---|---|---|---|---|")
    for model, counts in models.items():
        totals = [
            sum(n * ns_flops(*shape, STEPS, method, RESTART) for shape, n in counts.items()) for method in METHODS
        ]
        gram = sum(n for shape, n in counts.items() if runs_gram(*shape, "gram"))
        print(
            f"| {model} | {sum(counts.values())} | {gram} | {totals[0] / 1e12:.2f} | {totals[1] / 1e12:.2f} "
            f"| {totals[1] / totals[0]:.3f} |"
        )


if __name__ == "__main__":
    main()
