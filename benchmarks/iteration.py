"""CPU iteration benchmark: a real training iteration (forward + backward + optimizer step) of
the example model on 4 gloo ranks, canzona with overlap off and on against DP-SC (same math,
DDP-like) and DDP + torch.optim.AdamW, measured in one run, next to the simulator's
prediction of the same runs.

Run:  python benchmarks/iteration.py                    (TP 2 x DP 2 and DP 4, about 2 minutes)
      python benchmarks/iteration.py --layout dp4 --quick
      python benchmarks/iteration.py --write BENCHMARKS.md   (replaces its section: keep the prose by hand)

Strategies, each on its own copy of the model (examples/tiny_qwen3.py, Qwen3-style, fp32):

- `fwd+bwd`: forward and backward alone (no optimizer, no reduction): the compute the others
  share, and the measured training throughput the simulator is given;
- `canzona off`: CanzonaOptimizer (Muon), gradients reduced and parameters gathered inside step();
- `canzona`: its defaults, the gradient reduction overlapped with backward;
- `canzona +gather`: also the parameter gather overlapped with the next forward;
- `canzona a2a`: its defaults with `dp_collectives="all_to_all"` (one all_to_all_single per
  bucket and direction instead of a reduce / broadcast per slice owner);
- `tp-sc` (TP > 1 only; at TP 1 it is canzona): TpScOptimizer, canzona's DP geometry, every TP
  rank updates every matrix it owns, overlapped like canzona;
- `dp-sc`: DpScOptimizer, all-reduce per bucket overlapped with backward (DDP-like), every rank
  updates everything;
- `ddp-adamw`: torch's DistributedDataParallel over the DP group (buckets of the schedule's
  size) and torch.optim.AdamW.

Iterations run in blocks of K per strategy, strategies in turn, so background load hits all
alike; an iteration's time is the slowest rank's (ranks start together after a barrier); the
first iteration of a block is dropped (it finds no gathers in flight), the table shows medians.
The prediction: `canzona simulate`'s model on the checked-in CPU profile shared by 4 ranks
(schedules/profiles/cpu-dev.yaml: kernel times, contention, gloo α–β), forward and backward at
the throughput `fwd+bwd` measured in this run, fp32 parameter gathers, this run's batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from bench_md import write_section  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script

from canzona.planner.compile import compile_schedule  # noqa: E402
from canzona.planner.partition.costs import OptimizerConfig  # noqa: E402
from canzona.planner.plan import PlanRequest, TrainingSetup, make_plan  # noqa: E402
from canzona.planner.predict.hardware import resolve_device, shared_host  # noqa: E402
from canzona.planner.predict.simulate import simulate  # noqa: E402
from canzona.planner.sources.load import load_model  # noqa: E402
from canzona.runtime import CanzonaOptimizer, DpScOptimizer, TpScOptimizer, make_groups  # noqa: E402
from canzona.schedules.format import Schedule  # noqa: E402

from tiny_qwen3 import TinyConfig, TinyQwen3, init_full_state, shard_state, synthetic_batch  # noqa: E402

MODEL = {  # the runtime step benchmark's Qwen3-style model: about 5M parameters
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
LAYOUTS = {"tp2xdp2": (2, 2), "dp4": (1, 4)}
BUCKET = 1 << 20  # elements per bucket (4 MiB of fp32 gradients), DDP's bucket_cap_mb alike
HP = {"lr": 0.02, "adamw_lr": 3e-4}
STRATEGIES = ["fwd+bwd", "canzona off", "canzona", "canzona +gather", "canzona a2a", "tp-sc", "dp-sc", "ddp-adamw"]
TIMEOUT = timedelta(seconds=300)
HEADING = "## Training iteration (CPU): measured and predicted"


def make_schedule(config_path: str, dp: int, tp: int) -> Schedule:
    """A Muon schedule for the benchmark model (1 Mi-element buckets, 1 MiB micro-groups)."""
    spec = load_model(config_path, tp)  # the example model trains in fp32
    spec = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, dtype="fp32") for p in spec.params))
    request = PlanRequest(
        config_path, tp, dp, optimizer=OptimizerConfig("muon"), bucket_size=BUCKET, group_bytes=1 << 20
    )
    return compile_schedule(make_plan(spec, request))


def strategies(tp: int) -> list[str]:
    """The strategies measured at this TP size (TP-SC only where it differs from canzona)."""
    return [name for name in STRATEGIES if name != "tp-sc" or tp > 1]


def _build(name: str, cfg: TinyConfig, schedule: Schedule, groups: tuple[Any, Any], tp_rank: int) -> tuple[Any, Any]:
    """A fresh model copy and what steps it (None for fwd+bwd)."""
    dp_group, tp_group = groups
    model = TinyQwen3(cfg, tp_group)
    model.load_state_dict(shard_state(init_full_state(cfg), schedule.request.tp, tp_rank))
    named = list(model.named_parameters())
    if name == "fwd+bwd":
        return model, None
    if name == "ddp-adamw":
        wrapped = DistributedDataParallel(model, process_group=dp_group, bucket_cap_mb=BUCKET * 4 / 2**20)
        return wrapped, torch.optim.AdamW(model.parameters(), lr=HP["adamw_lr"])
    options = {
        "canzona off": {"overlap_grad_reduce": False},
        "canzona": {},
        "canzona +gather": {"overlap_param_gather": True, "model": model},
        "canzona a2a": {"dp_collectives": "all_to_all"},
        "tp-sc": {},
        "dp-sc": {},
    }[name]
    kind = {"dp-sc": DpScOptimizer, "tp-sc": TpScOptimizer}.get(name, CanzonaOptimizer)
    return model, kind(named, schedule, dp_group=dp_group, tp_group=tp_group, **options, **HP)


def _iteration(model: Any, optimizer: Any, tokens: torch.Tensor) -> float:
    """One timed iteration: the slowest rank's seconds (ranks start together)."""
    dist.barrier()
    started = time.perf_counter()
    model(tokens).backward()
    if optimizer is None:
        model.zero_grad()
    else:
        optimizer.step()
        optimizer.zero_grad()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _rank_main(
    rank: int,
    world: int,
    init_file: str,
    schedule: Schedule,
    cfg: TinyConfig,
    batch: int,
    seq: int,
    blocks: int,
    per_block: int,
    results: Any,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    dp, tp = schedule.request.dp, schedule.request.tp
    dp_rank, tp_rank = divmod(rank, tp)
    groups = make_groups(dp, tp, TIMEOUT)
    built = {name: _build(name, cfg, schedule, groups, tp_rank) for name in strategies(tp)}
    times: dict[str, list[float]] = {name: [] for name in built}
    counter = 0
    for block in range(blocks + 1):  # block 0 warms up
        for name, (model, optimizer) in built.items():
            for index in range(per_block):
                counter += 1
                tokens = synthetic_batch(cfg, batch, seq, seed=counter * dp + dp_rank)
                elapsed = _iteration(model, optimizer, tokens)
                if block > 0 and index > 0:
                    times[name].append(elapsed)
            if isinstance(optimizer, CanzonaOptimizer):
                optimizer.finish_gather()  # nothing in flight while the next strategy runs
    if rank == 0:
        results.put({name: statistics.median(values) for name, values in times.items()})
    dist.barrier()
    dist.destroy_process_group()


def measure(schedule: Schedule, cfg: TinyConfig, batch: int, seq: int, blocks: int, per_block: int) -> dict[str, float]:
    """Spawn the ranks (fork); each strategy's median iteration seconds."""
    world = schedule.request.dp * schedule.request.tp
    context = mp.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        args = (world, init_file, schedule, cfg, batch, seq, blocks, per_block, results)
        processes = [context.Process(target=_rank_main, args=(r, *args)) for r in range(world)]
        for process in processes:
            process.start()
        try:
            medians = _collect(results, processes)
        finally:
            for process in processes:
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
    return medians


def _collect(results: Any, processes: list[Any]) -> dict[str, float]:
    """Rank 0's medians; a clear error (not a hang) as soon as a rank dies."""
    while True:
        try:
            return results.get(timeout=1)
        except queue.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(
                    f"iteration.py: error: a rank exited with code {failed[0]} (its traceback is above)"
                ) from None


def predict(schedule: Schedule, measured_fwd_bwd: float, batch: int, seq: int) -> dict[str, float]:
    """The simulator's iteration seconds of the same runs (see the module docstring)."""
    dp, tp = schedule.request.dp, schedule.request.tp
    device = shared_host(resolve_device("cpu"), dp * tp)
    local = sum(e.numel for e in schedule.params)  # this device's parameters (TP shards)
    tokens = batch * (seq - 1)  # per DP rank: every position predicts the next token
    hardware = replace(device.hardware, train_flops=6.0 * local * tokens / measured_fwd_bwd)
    opt = schedule.request.optimizer
    time_model = device.time_model(OptimizerConfig(**opt.model_dump()))
    training = TrainingSetup(global_batch=batch * dp, seq_len=seq - 1, micro_batches=1)
    out: dict[str, float] = {"fwd+bwd": measured_fwd_bwd}
    runs = (
        ("canzona off", "schedule", False, False),
        ("canzona", "schedule", True, False),
        ("canzona +gather", "schedule", True, True),
        ("canzona a2a", "all_to_all", True, False),
    )
    for name, collectives, grad, gather in runs:
        sim = simulate(
            schedule,
            hardware,
            time_model,
            publish_bytes=4,
            dp_collectives=collectives,
            training=training,
            overlap_grad_reduce=grad,
            overlap_param_gather=gather,
        )
        out[name] = sim.iteration("canzona").iteration
        if name == "canzona":
            for baseline in ("tp-sc", "dp-sc", "ddp-adamw"):
                out[baseline] = sim.iteration(baseline).iteration
    return out


def table(rows: list[tuple[str, Schedule, dict[str, float], dict[str, float]]], batch: int, seq: int) -> str:
    """The markdown table: measured and predicted ms, ratios to canzona, the ratio error."""
    lines = [
        f"Example model (examples/tiny_qwen3.py: h {MODEL['hidden_size']}, F {MODEL['intermediate_size']}, "
        f"L {MODEL['num_hidden_layers']}, vocab {MODEL['vocab_size']}, fp32), Muon, 4 gloo ranks on "
        f"{os.cpu_count()} CPU cores (one thread each), {batch} sequences of {seq - 1} tokens per DP rank, "
        f"1 Mi-element buckets; medians of the slowest rank's iteration. Ratio = strategy / canzona (its "
        "defaults: gradient reduction overlapped, gather not); error = predicted ratio / measured ratio - 1.",
        "",
        "| layout | strategy | measured ms | predicted ms | measured ratio | predicted ratio | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, _, measured, predicted in rows:
        for name in measured:
            m_ratio, p_ratio = measured[name] / measured["canzona"], predicted[name] / predicted["canzona"]
            error = "" if name == "fwd+bwd" else f"{100 * (p_ratio / m_ratio - 1):+.0f}%"
            lines.append(
                f"| {layout} | {name} | {measured[name] * 1e3:.0f} | {predicted[name] * 1e3:.0f} "
                f"| {m_ratio:.2f}x | {p_ratio:.2f}x | {error} |"
            )
    return "\n".join(lines)


def main() -> None:
    """Measure and predict every layout; print (optionally write) the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=[*LAYOUTS, "both"], default="both")
    parser.add_argument("--batch", type=int, default=4, help="sequences per DP rank")
    parser.add_argument("--seq", type=int, default=33, help="tokens per sequence (seq - 1 are predicted)")
    parser.add_argument("--blocks", type=int, default=4, help="timed blocks per strategy")
    parser.add_argument("--per-block", type=int, default=4, help="iterations per block (the first is dropped)")
    parser.add_argument("--quick", action="store_true", help="2 blocks of 3")
    parser.add_argument("--write", type=Path, help="update this BENCHMARKS.md (only if it exists)")
    args = parser.parse_args()
    blocks, per_block = (2, 3) if args.quick else (args.blocks, args.per_block)
    cfg = TinyConfig.from_hf(MODEL)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "bench_qwen3.json"
        config.write_text(json.dumps(MODEL))
        for layout in LAYOUTS if args.layout == "both" else [args.layout]:
            tp, dp = LAYOUTS[layout]
            schedule = make_schedule(str(config), dp, tp)
            measured = measure(schedule, cfg, args.batch, args.seq, blocks, per_block)
            predicted = predict(schedule, measured["fwd+bwd"], args.batch, args.seq)
            label = f"TP {tp} x DP {dp}" if tp > 1 else f"DP {dp}"
            rows.append((label, schedule, measured, predicted))
            print(
                f"{label}: " + ", ".join(f"{k} {v * 1e3:.0f}/{predicted[k] * 1e3:.0f} ms" for k, v in measured.items()),
                file=sys.stderr,
                flush=True,
            )
    text = table(rows, args.batch, args.seq)
    print(text)
    if args.write is not None and args.write.exists():
        write_section(args.write, HEADING, text, "python benchmarks/iteration.py")


if __name__ == "__main__":
    main()
