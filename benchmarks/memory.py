"""Memory benchmark: peak optimizer memory per parameter on this CPU (gloo), bf16 parameters.

Run:  python benchmarks/memory.py                 (DP 1 on one rank, DP 4 on four ranks; Muon; ~1 min)
      python benchmarks/memory.py --optimizer muon,shampoo,soap
      python benchmarks/memory.py --write BENCHMARKS.md

What is measured, per rank: the growth of the process's peak resident memory (VmHWM, reset
through /proc/self/clear_refs) from the moment the parameters and their bf16 gradients exist
to the end of three optimizer steps: construction, buffers, state, main copies and every
transient of a step. glibc is told to return large freed blocks at once, so that the peak
follows live memory rather than the allocator's retention. Divided by the number of
parameters of the whole model, this is "bytes per parameter above params + grads", the figure
the design targets are stated in.

The floor printed beside it is what the design must hold per rank, with P_m matrix elements,
P_a AdamW elements, D the DP size, and every element of the model packed once into the fp32
reduction buffer:

    4·(P_m + P_a)  +  (4 main + state) · P_m / D  +  (4 main + 8 moments) · P_a / D

(Muon's state is its momentum, 4 bytes). Transients come on top: a micro-group's Newton-Schulz
workspace (bounded by the schedule's group capacity, `--group-mb`) and a DP bucket's collective
buffers (bounded by the bucket size). The benchmark's model is small, so its group capacity and
bucket size are scaled down to the same share of the model as the defaults are of qwen3-1.7b.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_md import write_section

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.runtime import CanzonaOptimizer, make_groups
from canzona.runtime.schedule import DTYPES
from canzona.schedules.format import Schedule
from canzona.schedules.layout import local_shape

# A Qwen3-style decoder of ~23M parameters whose embedding and output layer (AdamW) are 18 % of
# the model, as in qwen3-1.7b; large enough that fixed costs (threads, allocator arenas) are
# small beside the optimizer's buffers.
MODEL = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 4096,
    "tie_word_embeddings": False,
}
GROUP_MB = 16  # micro-group capacity: 0.7 B/param here, as 2 GiB is for qwen3-1.7b (1.2 B/param)
BUCKET = 1 << 20  # elements per DP bucket: 24 buckets here, as 40M-element buckets give qwen3-1.7b 43
STEPS = 3
TIMEOUT = timedelta(seconds=600)
HEADING = "## Optimizer memory (CPU)"
STATE_BYTES = {"muon": 4}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = (
    -1,
    -3,
)  # glibc's mallopt parameters  # per matrix element; Shampoo/SOAP state depends on shapes (not floored here)


def make_schedule(config: str, dp: int, optimizer: str) -> Schedule:
    """The benchmark's schedule: bf16 parameters, TP 1, small micro-groups."""
    spec = load_model(config, 1)
    spec = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, dtype="bf16") for p in spec.params))
    request = PlanRequest(
        config, 1, dp, optimizer=OptimizerConfig(optimizer), bucket_size=BUCKET, group_bytes=GROUP_MB << 20
    )
    return compile_schedule(make_plan(spec, request))


def _rss(field: str) -> int:
    """A VmRSS / VmHWM figure of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert match is not None, f"no {field} in /proc/self/status"
    return int(match.group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _return_freed_memory() -> None:
    """Make glibc give large freed blocks back at once (a fixed mmap threshold instead of its
    dynamic one, which keeps freed blocks resident and grows with every free): peak RSS then
    follows peak live memory, as a GPU caching allocator's peak does."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 16)


def _warm_up(schedule: Schedule) -> None:
    """What a training job has paid before its optimizer first steps, done before the baseline:
    the CPU BLAS keeps packing buffers (tens of MiB) after its first large product (the first
    forward's), and building any torch.optim optimizer imports modules worth ~25 MiB."""
    rows, cols = max((tuple(e.shape) for e in schedule.params if len(e.shape) == 2), key=lambda s: s[0] * s[1])
    x = torch.randn(2, min(rows, cols), max(rows, cols))
    gram = torch.bmm(x, x.mT)
    torch.baddbmm(x, torch.baddbmm(gram, gram, gram), x)
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()


def _rank_main(rank: int, world: int, init_file: str, schedule: Schedule, results: Any) -> None:
    _return_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    dp_group, tp_group = make_groups(world, 1, TIMEOUT)
    generator = torch.Generator().manual_seed(rank)
    params = []
    for entry in sorted(schedule.params, key=lambda e: e.index):
        shape = local_shape(entry, 1, 0)
        param = torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(DTYPES[entry.dtype]))
        param.grad = torch.randn(shape, generator=generator).to(param.dtype)
        params.append((entry.name, param))
    _warm_up(schedule)
    dist.barrier()
    baseline = _rss("VmRSS")
    _reset_peak()
    optimizer = CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group)
    for _ in range(STEPS):
        optimizer.step()
    results.put((rank, (_rss("VmHWM") - baseline, _rss("VmRSS") - baseline)))
    dist.barrier()
    dist.destroy_process_group()


def measure(schedule: Schedule) -> list[tuple[int, int]]:
    """Every rank's (peak, final) memory growth in bytes, DP ranks forked on gloo."""
    world = schedule.request.dp
    context = mp.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_rank_main, args=(r, world, init_file, schedule, results)) for r in range(world)
        ]
        for process in processes:
            process.start()
        grown = dict(results.get(timeout=1200) for _ in range(world))
        for process in processes:
            process.join()
    return [grown[r] for r in range(world)]


def floor_bytes(schedule: Schedule) -> float | None:
    """The design floor per rank in bytes (module docstring); None where the state has no fixed size."""
    state = STATE_BYTES.get(schedule.request.optimizer.name)
    if state is None:
        return None
    dp = schedule.request.dp
    matrix = sum(e.numel for e in schedule.params if e.optimizer == "matrix")
    adamw = sum(e.numel for e in schedule.params if e.optimizer != "matrix")
    return 4 * (matrix + adamw) + (4 + state) * matrix / dp + 12 * adamw / dp


def table(rows: list[tuple[Schedule, list[tuple[int, int]]]]) -> str:
    """The markdown table of the run."""
    lines = [
        f"Memory above params + grads, bytes per model parameter (per rank, gloo, bf16 parameters, {STEPS} steps, "
        f"micro-groups of {GROUP_MB} MiB, buckets of {BUCKET >> 20} Mi elements); model: Qwen3-style h "
        f"{MODEL['hidden_size']}, F {MODEL['intermediate_size']}, L {MODEL['num_hidden_layers']}, vocab "
        f"{MODEL['vocab_size']}. Peak: peak RSS growth of the worst rank; held: what stays resident after the "
        "steps (buffers and state); transient: peak − held; the planner's prediction: the schedule's "
        "metrics.device peak_bytes (what `canzona show` prints). Targets: at DP 1 a peak of 14; at DP D, held "
        "within 4 + 10/D plus 8/D per AdamW element (their second moment), transients on top.",
        "",
        "| optimizer | DP | parameters | AdamW share | peak | held | transient | design floor | peak / floor "
        "| planner's prediction | peak / prediction | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for schedule, grown in rows:
        total = sum(e.numel for e in schedule.params)
        adamw = sum(e.numel for e in schedule.params if e.optimizer != "matrix") / total
        dp = schedule.request.dp
        floor = floor_bytes(schedule)
        peak, held = (max(values) / total for values in zip(*grown))
        floor_text = f"{floor / total:.2f}" if floor is not None else "-"
        ratio = f"{peak / (floor / total):.2f}x" if floor is not None else "-"
        target = "peak 14" if dp == 1 else f"held {4 + 10 / dp + 8 * adamw / dp:.2f}"
        target = target if schedule.request.optimizer.name == "muon" else "-"  # the targets are Muon's
        predicted = max(d.peak_bytes or 0.0 for d in schedule.metrics.device) / total
        lines.append(
            f"| {schedule.request.optimizer.name} | {dp} | {total / 1e6:.1f}M | {adamw:.0%} | {peak:.2f} "
            f"| {held:.2f} | {peak - held:.2f} | {floor_text} | {ratio} | {predicted:.2f} "
            f"| {peak / predicted:.3f} | {target} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Measure DP 1 and DP 4 and print (optionally write) the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--optimizer", default="muon", help="comma-separated matrix optimizers: muon, shampoo, soap (default muon)"
    )
    parser.add_argument("--dp", default="1,4", help="comma-separated DP sizes (default 1,4)")
    parser.add_argument("--write", type=Path, help="update this BENCHMARKS.md (only if it exists)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "memory_qwen3.json"
        config.write_text(json.dumps(MODEL))
        for optimizer, dp in ((o, int(d)) for o in args.optimizer.split(",") for d in args.dp.split(",")):
            schedule = make_schedule(str(config), dp, optimizer)
            grown = measure(schedule)
            for rank, (peak, held) in enumerate(grown):  # one line per rank, so the ranks read apart
                print(
                    f"{optimizer} dp {dp} rank {rank}: peak {peak / 2**20:.0f} MiB, held {held / 2**20:.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
            rows.append((schedule, grown))
    text = table(rows)
    print(text)
    if args.write is not None and args.write.exists():
        write_section(args.write, HEADING, text, "python " + " ".join(["benchmarks/memory.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
