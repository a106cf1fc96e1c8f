"""Runtime benchmark: optimizer step latency of canzona vs DP-SC vs TP-SC on this CPU (gloo),
with fp32 parameters and with bf16 parameters (fp32 main copies, values gathered in bf16), on a
dense model and on an MoE model under expert parallelism (EP 2: experts reduced over the
expert-DP group).

Run:  python benchmarks/runtime_step.py             (2 and 4 ranks, Muon, fp32 and bf16, dense and MoE, minutes)
      python benchmarks/runtime_step.py --models moe (the MoE layouts only)
      python benchmarks/runtime_step.py --quick     (fewer steps)
      python benchmarks/runtime_step.py --dtype bf16
      python benchmarks/runtime_step.py --write BENCHMARKS.md

Every strategy runs in the same process group on the same model, schedule and gradients, steps
interleaved (canzona, TP-SC, DP-SC, canzona, ...) so background load hits them alike; a
step's latency is the slowest rank's `step()` time (ranks start together after a barrier);
the table shows medians over the timed steps after warm-up, and ratios baseline / canzona.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial
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
from canzona.runtime import CanzonaOptimizer, DpScOptimizer, TpScOptimizer, make_groups
from canzona.runtime.schedule import DTYPES
from canzona.schedules.format import Schedule

# A small Qwen3-style decoder: large enough that optimizer compute dominates on one core.
MODEL = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 2048,
    "tie_word_embeddings": False,
}
# A small Qwen3-MoE-style decoder: layer 0 dense, then 8 experts per layer (top-2), planned with
# Megatron names; the router is a matrix, as the planner records it.
MOE_MODEL = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 2048,
    "tie_word_embeddings": False,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}
LAYOUTS = {
    "dense": [(2, 1, 1), (1, 2, 1), (2, 2, 1), (4, 1, 1)],
    "moe": [(2, 1, 2), (4, 1, 2), (2, 2, 2)],
}  # (dp, tp, ep)
STRATEGIES = {
    "canzona": CanzonaOptimizer,  # each bucket's DP collective as the schedule records it (the default)
    "canzona-a2a": partial(CanzonaOptimizer, dp_collectives="all_to_all"),  # one all_to_all per bucket
    "tp-sc": TpScOptimizer,
    "dp-sc": DpScOptimizer,
}
TIMEOUT = timedelta(seconds=300)
HEADING = "## Runtime step latency (CPU)"


def make_schedule(
    config_path: str, dp: int, tp: int, optimizer: str, group_mb: float, dtype: str = "fp32", ep: int = 1
) -> Schedule:
    """A canzona schedule for a benchmark model (`dtype` parameters, 1 Mi-element buckets)."""
    spec = load_model(config_path, tp)
    spec = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, dtype=dtype) for p in spec.params))
    request = PlanRequest(
        config_path,
        tp,
        dp,
        optimizer=OptimizerConfig(optimizer),
        bucket_size=1 << 20,
        group_bytes=int(group_mb * (1 << 20)),
        ep=ep,
    )
    return compile_schedule(make_plan(spec, request))


def _timed_step(optimizer: Any) -> float:
    """The slowest rank's time of one step() (ranks start together)."""
    dist.barrier()
    started = time.perf_counter()
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _make_optimizer(strategy: Any, schedule: Schedule, groups: dict[str, Any], seed: int) -> Any:
    """`strategy` on fresh local parameters (this EP rank's experts) with fixed random gradients."""
    tp, ep = schedule.request.tp, schedule.request.ep
    ep_rank = (dist.get_rank() // tp) % ep
    generator = torch.Generator().manual_seed(seed)
    params = []
    for entry in sorted(schedule.params, key=lambda e: e.index):
        if entry.ep_rank not in (None, ep_rank):
            continue
        shape = list(entry.shape)
        if entry.tp_dim is not None:
            shape[entry.tp_dim] //= tp
        dtype = DTYPES[entry.dtype]
        param = torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(dtype))
        param.grad = torch.randn(shape, generator=generator).to(dtype)
        params.append((entry.name, param))
    return strategy(params, schedule, **groups)


def _rank_main(
    rank: int, world: int, init_file: str, schedule: Schedule, warmup: int, steps: int, results: Any
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    req = schedule.request
    if req.ep == 1:
        dp_group, tp_group = make_groups(req.dp, req.tp, TIMEOUT)
        groups = {"dp_group": dp_group, "tp_group": tp_group}
    else:
        dp_group, tp_group, expert_group = make_groups(req.dp, req.tp, TIMEOUT, ep=req.ep)
        groups = {"dp_group": dp_group, "tp_group": tp_group, "expert_dp_group": expert_group}
    optimizers = {name: _make_optimizer(strategy, schedule, groups, rank) for name, strategy in STRATEGIES.items()}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for index in range(warmup + steps):
        for name, optimizer in optimizers.items():  # interleaved: background noise hits all alike
            elapsed = _timed_step(optimizer)
            if index >= warmup:
                times[name].append(elapsed)
    if rank == 0:
        results.put({name: statistics.median(values) for name, values in times.items()})
    dist.barrier()
    dist.destroy_process_group()


def run_layout(schedule: Schedule, warmup: int, steps: int) -> dict[str, float]:
    """Spawn dp·tp ranks (fork) and return each strategy's median step seconds."""
    world = schedule.request.dp * schedule.request.tp
    context = mp.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_rank_main, args=(r, world, init_file, schedule, warmup, steps, results))
            for r in range(world)
        ]
        for process in processes:
            process.start()
        medians = results.get(timeout=1800)
        for process in processes:
            process.join()
    return medians


def table(rows: list[tuple[str, str, int, str, int, dict[str, float]]], optimizer: str, cores: int) -> str:
    """The markdown table of the run."""
    lines = [
        f"Optimizer step latency, {optimizer}, gloo on {cores} CPU cores, one thread per rank; dense model: "
        f"Qwen3-style h {MODEL['hidden_size']}, F {MODEL['intermediate_size']}, L {MODEL['num_hidden_layers']}, "
        f"vocab {MODEL['vocab_size']}; "
        f"MoE model: the same with {MOE_MODEL['num_experts']} experts of F {MOE_MODEL['moe_intermediate_size']} "
        f"(top-{MOE_MODEL['num_experts_per_tok']}) in layers 1-3; "
        "median of the slowest rank's step() (ms). With 4 ranks on 2 cores the ranks share cores, so times "
        "there count total CPU work. Absolute times move with machine load; the ratios (steps interleaved) are "
        "the stable part.",
        "",
        "| model | params | ranks | layout | micro-groups/rank | canzona ms | canzona all_to_all ms | TP-SC ms "
        "| DP-SC ms | DP-SC / canzona | TP-SC / canzona | all_to_all / canzona |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, dtype, world, layout, groups, medians in rows:
        c, r, t, d = (medians[k] * 1e3 for k in ("canzona", "canzona-a2a", "tp-sc", "dp-sc"))
        lines.append(
            f"| {model} | {dtype} | {world} | {layout} | {groups} | {c:.1f} | {r:.1f} | {t:.1f} | {d:.1f} "
            f"| {d / c:.2f}x | {t / c:.2f}x | {r / c:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    """Run every layout and print (optionally write) the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 warm-up and 3 timed steps")
    parser.add_argument("--optimizer", default="muon", choices=["muon", "shampoo", "soap"])
    parser.add_argument("--group-mb", type=float, default=1.0, help="micro-group capacity (MiB per host)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both", help="parameter dtype")
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--write", type=Path, help="update this BENCHMARKS.md (only if it exists)")
    args = parser.parse_args()
    warmup, steps = (2, 3) if args.quick else (3, 9)
    models = [m for m in args.models.split(",") if m]
    if not models or set(models) - set(LAYOUTS):
        parser.error(f"--models takes a comma-separated list of {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as folder:
        configs = {"dense": Path(folder) / "bench_qwen3.json", "moe": Path(folder) / "bench_qwen3_moe.json"}
        configs["dense"].write_text(json.dumps(MODEL))
        configs["moe"].write_text(json.dumps(MOE_MODEL))
        rows = []
        for model in models:
            for dtype in ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]:
                for dp, tp, ep in LAYOUTS[model]:
                    schedule = make_schedule(str(configs[model]), dp, tp, args.optimizer, args.group_mb, dtype, ep)
                    groups = max(len(rank.groups) for rank in schedule.tp.ranks)
                    medians = run_layout(schedule, warmup, steps)
                    layout = f"DP {dp} x TP {tp}" if ep == 1 else f"EP {ep} x DP {dp} (expert-DP {dp // ep}) x TP {tp}"
                    rows.append((model, dtype, dp * tp, layout, groups, medians))
                    print(
                        f"{model} {dtype} {layout}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items()),
                        file=sys.stderr,
                        flush=True,
                    )
    text = table(rows, args.optimizer, os.cpu_count() or 1)
    print(text)
    if args.write is not None and args.write.exists():
        write_section(args.write, HEADING, text, "python benchmarks/runtime_step.py")


if __name__ == "__main__":
    main()
