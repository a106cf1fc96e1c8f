"""Checkpoint benchmark: save and load times of the logical optimizer state (DCP, gloo, CPU).

Run:  python benchmarks/checkpoint_bench.py                  (Muon, Shampoo, SOAP; about a minute)
      python benchmarks/checkpoint_bench.py --write BENCHMARKS.md

The model is runtime_step.py's (Qwen3-style h 256, F 1024, L 4, vocab 2048, fp32). Per matrix
optimizer: 2 steps under DP 2 x TP 2, then the slowest rank's time of `save_checkpoint`,
`load_checkpoint` under the same schedule, and `load_checkpoint` under DP 4 x TP 1 (a
resharding load), medians of a few repetitions, with the checkpoint's size on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_md import write_section
from runtime_step import MODEL, TIMEOUT, _make_optimizer, make_schedule

from canzona.runtime import CanzonaOptimizer, load_checkpoint, make_groups, save_checkpoint
from canzona.schedules.format import Schedule

HEADING = "## Checkpoint save and load (CPU)"
REPEATS = 3


def _timed(call: Callable[[], Any]) -> float:
    """The slowest rank's seconds for one collective call."""
    dist.barrier()
    started = time.perf_counter()
    call()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _rank_main(
    rank: int, world: int, init_file: str, schedules: tuple[Schedule, Schedule], folder: str, results: Any
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    first, second = schedules
    optimizer = _make_optimizer(CanzonaOptimizer, first, make_groups(first.request.dp, first.request.tp, TIMEOUT), rank)
    for _ in range(2):
        optimizer.step()
    save = [_timed(lambda: save_checkpoint(optimizer, folder)) for _ in range(REPEATS)]
    same = [_timed(lambda: load_checkpoint(optimizer, folder)) for _ in range(REPEATS)]
    other = _make_optimizer(CanzonaOptimizer, second, make_groups(second.request.dp, second.request.tp, TIMEOUT), rank)
    moved = [_timed(lambda: load_checkpoint(other, folder)) for _ in range(REPEATS)]
    if rank == 0:
        size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        results.put(
            {
                "save": statistics.median(save),
                "load": statistics.median(same),
                "reshard": statistics.median(moved),
                "bytes": size,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def measure(config: str, optimizer: str) -> dict[str, float]:
    """Save / load / resharding-load seconds and checkpoint bytes for one matrix optimizer."""
    first = make_schedule(config, 2, 2, optimizer, 8.0)
    second = make_schedule(config, 4, 1, optimizer, 8.0)
    context = mp.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        init_file, folder = os.path.join(scratch, "rendezvous"), os.path.join(scratch, "checkpoint")
        processes = [
            context.Process(target=_rank_main, args=(r, 4, init_file, (first, second), folder, results))
            for r in range(4)
        ]
        for process in processes:
            process.start()
        measured = results.get(timeout=1800)
        for process in processes:
            process.join()
    return measured


def table(rows: dict[str, dict[str, float]], cores: int) -> str:
    """The markdown table of the run."""
    lines = [
        f"Logical optimizer state through torch.distributed.checkpoint, gloo on {cores} CPU cores, 4 ranks, local "
        f"disk; model: Qwen3-style h {MODEL['hidden_size']}, F {MODEL['intermediate_size']}, "
        f"L {MODEL['num_hidden_layers']}, vocab {MODEL['vocab_size']}, fp32; saved under DP 2 x TP 2 after 2 steps; "
        f"median of {REPEATS} of the slowest rank's time (ms). Loads verify every file's sha256 first (each rank a "
        "share).",
        "",
        "| optimizer | checkpoint MiB | save ms | load ms (same schedule) | load ms (DP 4 x TP 1) |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['bytes'] / (1 << 20):.1f} | {row['save'] * 1e3:.0f} | {row['load'] * 1e3:.0f} "
            f"| {row['reshard'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Measure and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="update this BENCHMARKS.md section")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = os.path.join(folder, "model.json")
        Path(config).write_text(json.dumps(MODEL))
        rows = {name: measure(config, name) for name in ("muon", "shampoo", "soap")}
    text = table(rows, os.cpu_count() or 1)
    print(text)
    if args.write:
        write_section(args.write, HEADING, text, "python benchmarks/checkpoint_bench.py")


if __name__ == "__main__":
    main()
