"""Numerics of cooperative hosting: how far a team's sharded Newton–Schulz moves from an fp64
reference, next to how far the unsharded fp32 one does.

Run:  python benchmarks/coop_numerics.py          (about a minute on 2 CPU cores)

A team of k gloo ranks runs the runtime's `team_newton_schulz` (canzona.runtime.rules.cooperative)
on its slices of a matrix (the long side split k ways, the r x r Gram all-reduced each
iteration), five iterations, Muon's coefficients. The matrices: Gaussian, and Gaussian with a
decaying spectrum (singular values 1 ... 1e-3, closer to momentum buffers), wide and tall.
Columns: normwise relative error ‖a − b‖ / ‖b‖ of the team against fp64 (`team/64`), of the
unsharded fp32 iteration against fp64 (`fp32/64`), of the team against the unsharded fp32
(`team/32`), and the rtol an elementwise check of the team against the unsharded fp32 needs
(`assert_close` with atol = rtol / 10, as benchmarks/numerics.py measures it).
"""

from __future__ import annotations

import sys
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))  # the tests' forked-rank harness

from canzona.runtime.rules.cooperative import team_newton_schulz  # noqa: E402
from canzona.runtime.rules.newton_schulz import newton_schulz  # noqa: E402

from rt_harness import run_ranks  # noqa: E402

STEPS = 5
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
SHAPES = [(256, 2048), (2048, 256), (512, 1024)]
TEAMS = [2, 4]


def _matrix(shape: tuple[int, int], kind: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(repr((shape, kind)).encode()))
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    if kind == "decaying":
        u, _, v = torch.linalg.svd(x, full_matrices=False)
        x = u @ torch.diag(torch.logspace(0, -3, min(shape), dtype=torch.float64)) @ v
    return x


def _worker(rank: int, world: int, matrix: torch.Tensor) -> torch.Tensor:
    dim = 0 if matrix.shape[0] > matrix.shape[1] else 1
    part = matrix.float().chunk(world, dim=dim)[rank].contiguous()
    return team_newton_schulz(part, dim, STEPS, COEFFICIENTS, dist.group.WORLD, timedelta(seconds=60))


def _normwise(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _needed_rtol(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want.double()).abs() / (0.1 + want.double().abs())).max())


def measure(shape: tuple[int, int], kind: str, k: int) -> dict[str, Any]:
    """One row of the table."""
    matrix = _matrix(shape, kind)
    dim = 0 if shape[0] > shape[1] else 1
    team = torch.cat(run_ranks(_worker, k, matrix, timeout=300.0), dim=dim)
    fp32, fp64 = newton_schulz(matrix.float(), STEPS, COEFFICIENTS), newton_schulz(matrix, STEPS, COEFFICIENTS)
    return {
        "team/64": _normwise(team, fp64),
        "fp32/64": _normwise(fp32, fp64),
        "team/32": _normwise(team, fp32),
        "rtol team/32": _needed_rtol(team, fp32),
    }


def main() -> None:
    """Print the table."""
    print("| matrix | k | team/64 | fp32/64 | team/32 | rtol team/32 |")
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        for kind in ("gaussian", "decaying"):
            for k in TEAMS:
                row = measure(shape, kind, k)
                cells = " | ".join(f"{row[key]:.1e}" for key in ("team/64", "fp32/64", "team/32", "rtol team/32"))
                print(f"| {shape[0]}x{shape[1]} {kind} | {k} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
