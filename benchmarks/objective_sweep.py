"""Objective sweep: does a larger α ever plan a slower step, and does any baseline beat canzona?

Run:  python benchmarks/objective_sweep.py                (the subsample below, a few minutes on 1 core)
      python benchmarks/objective_sweep.py --full         (the issue's whole grid)
      python benchmarks/objective_sweep.py --workers N    (layouts in N processes; same output)
      python benchmarks/objective_sweep.py --save FILE    (also write one CSV row per layout and α)

For each layout it plans at every α of the ladder {0, 0.25, 0.5, 0.75, 1} (what `canzona plan
--alpha A` writes at each A: `best_plans`, one pass up the ladder, then `compile_schedule`),
simulates each schedule on the built-in h100 model (`simulate`), and counts:
(a) α violations on the objective: a larger α whose predicted canzona optimizer step is larger
    than the step at some smaller α of the same layout (relative tolerance 1e-9); one per
    larger α, listed against the smaller α with the smallest step;
(b) α violations on the DP gap under ties: a larger α whose step equals (within 1e-9,
    relative) that of a smaller α but whose DP gap (`metrics.dp.gap`: max DP-rank load / lower
    bound - 1) is larger (by more than 1e-9; the gap is already relative to the bound); one per
    larger α, listed against the tied smaller α with the smallest gap;
(c) baseline losses at the default α (1): a matrix baseline (every simulated strategy except
    canzona, canzona-no-overlap and the references, `sim_baselines.REFERENCES`) whose predicted
    step, or whose predicted training iteration, is smaller than canzona's (baseline / canzona
    < 1 - 1e-9). The iteration is simulated at α = 1 only, for global batch = the smallest
    multiple of dp that is >= 256 and sequences of 4096 tokens (one sequence per micro-batch).

The issue's grid: every preset (`canzona.planner.sources.catalog.PRESETS`, what `canzona
models` lists) x TP {1, 2, 4, 8} x DP {12, 16, 24, 48, 64, 128} x optimizer {muon, shampoo,
soap} (936 layouts, in that order), MoE presets with every expert in the dense buffer (ep = 1);
layouts the planner refuses (PlanError, e.g. TP not dividing the KV heads) are skipped and
counted. `--full` runs it all: hours on one core, since planning at α plans every smaller ladder
α and the baseline-owner plans too, and deepseek-v3 and qwen3-235b-a22b (30k and 25k matrices
in one buffer at ep = 1) take minutes per layout. The default subsample, deterministic, in grid
order: the grid without those two presets (`HEAVY`), every 23rd layout (23 is prime to the 4
TP sizes, 6 DP sizes and 3 optimizers, and below the 72 layouts of a preset, so every other
preset, every TP, DP and optimizer is hit), plus the issue's example layouts (`EXAMPLES`).

Stdout (deterministic, the same for any --workers): the command, the layouts planned and
skipped, a table of counts, then every offending layout. Progress and times go to stderr. The
exit code is 0 whatever the counts (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import shlex
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest
from canzona.planner.predict.hardware import Hardware, resolve_device
from canzona.planner.predict.objective import best_plans
from canzona.planner.predict.sim_baselines import REFERENCES
from canzona.planner.predict.simulate import Simulation, simulate
from canzona.planner.request import TrainingSetup
from canzona.planner.sources.catalog import PRESETS
from canzona.planner.sources.load import load_model
from canzona.planner.spec import PlanError

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_ALPHA = 1.0  # the α `canzona plan` uses unless told otherwise: where (c) is measured
TPS = (1, 2, 4, 8)
DPS = (12, 16, 24, 48, 64, 128)
OPTIMIZERS = ("muon", "shampoo", "soap")
STRIDE = 23
HEAVY = ("deepseek-v3", "qwen3-235b-a22b")  # minutes per layout: --full only
EXAMPLES = (
    ("qwen3-0.6b", 8, 64, "muon"),
    ("qwen3-0.6b", 8, 128, "muon"),
    ("qwen3-0.6b", 4, 64, "muon"),
    ("llama3.1-8b", 4, 48, "shampoo"),
    ("qwen3-0.6b", 8, 64, "shampoo"),
)
DEVICE = "h100"
SEQ_LEN = 4096
MIN_GLOBAL_BATCH = 256
REL_TOL = 1e-9  # steps, iterations: relative
GAP_TOL = 1e-9  # DP gaps: absolute (a gap is already relative to the lower bound)
NOT_BASELINES = ("canzona", "canzona-no-overlap", *REFERENCES)

OBJECTIVE = "objective"
GAP_TIE = "dp gap under tie"
BASE_STEP = "baseline step"
BASE_ITERATION = "baseline iteration"
KINDS = (OBJECTIVE, GAP_TIE, BASE_STEP, BASE_ITERATION)
KIND_TITLES = {
    OBJECTIVE: "(a) alpha: a larger alpha predicts a larger step",
    GAP_TIE: "(b) alpha: steps tie, the larger alpha has a larger DP gap",
    BASE_STEP: "(c) alpha 1: a matrix baseline's step is smaller",
    BASE_ITERATION: "(c) alpha 1: a matrix baseline's iteration is smaller",
}


@dataclass(frozen=True)
class Layout:
    """One swept layout: preset, TP, DP, matrix optimizer (ep = 1)."""

    model: str
    tp: int
    dp: int
    optimizer: str

    @property
    def key(self) -> str:
        """The layout as the output names it."""
        return f"{self.model} tp{self.tp} dp{self.dp} {self.optimizer}"


@dataclass(frozen=True)
class AlphaPoint:
    """The plan at one α: canzona's predicted step (s), DP gap, max DP-rank load and TP update."""

    alpha: float
    step: float
    gap: float
    dp_max: float
    tp_update: str = "hosted"


@dataclass(frozen=True)
class BaselinePoint:
    """One matrix baseline's predicted step and iteration (s) at the default α."""

    name: str
    step: float
    iteration: float


@dataclass(frozen=True)
class Planned:
    """A planned layout: every α's point, and at the default α canzona's iteration and the baselines."""

    layout: Layout
    points: tuple[AlphaPoint, ...]
    iteration: float
    baselines: tuple[BaselinePoint, ...]


@dataclass(frozen=True)
class Skipped:
    """A layout the planner refuses, and why."""

    layout: Layout
    reason: str


Outcome = Planned | Skipped


@dataclass(frozen=True)
class Finding:
    """One offending layout: what was compared (α pair or baseline), the reference value (the
    smaller α's, or canzona's) and the other one."""

    kind: str
    layout: Layout
    what: str
    reference: float
    other: float
    ratio: float


def grid() -> list[Layout]:
    """The issue's whole grid, in preset, TP, DP, optimizer order."""
    return [Layout(name, tp, dp, opt) for name in PRESETS for tp in TPS for dp in DPS for opt in OPTIMIZERS]


def layouts(full: bool, stride: int = STRIDE) -> list[Layout]:
    """The swept layouts in grid order: the whole grid, or every `stride`-th layout of the grid
    without the `HEAVY` presets, plus `EXAMPLES`."""
    everything = grid()
    if full:
        return everything
    light = [layout for layout in everything if layout.model not in HEAVY]
    chosen = set(light[::stride]) | {Layout(*example) for example in EXAMPLES}
    return [layout for layout in everything if layout in chosen]


def global_batch(dp: int) -> int:
    """The smallest multiple of dp that is >= `MIN_GLOBAL_BATCH` sequences."""
    return -(-MIN_GLOBAL_BATCH // dp) * dp


@cache
def hardware() -> Hardware:
    """The simulated device (one per process)."""
    return resolve_device(DEVICE).hardware


def matrix_baselines(sim: Simulation) -> tuple[BaselinePoint, ...]:
    """Every matrix baseline of a simulation with training, in the simulator's order."""
    return tuple(
        BaselinePoint(s.name, s.step, sim.iteration(s.name).iteration)
        for s in sim.strategies
        if s.name not in NOT_BASELINES
    )


def sweep_layout(layout: Layout) -> Outcome:
    """Plan, compile and simulate one layout at every α (training at the default α only)."""
    try:
        model = load_model(layout.model, layout.tp)
        points: list[AlphaPoint] = []
        iteration = 0.0
        baselines: tuple[BaselinePoint, ...] = ()
        request = PlanRequest(layout.model, layout.tp, layout.dp, optimizer=OptimizerConfig(name=layout.optimizer))
        # What `canzona plan --alpha A` writes at every A, in one pass up the ladder.
        for alpha, plan in zip(ALPHAS, best_plans(model, request, ALPHAS)):
            schedule = compile_schedule(plan)
            if alpha == DEFAULT_ALPHA:
                training = TrainingSetup(global_batch=global_batch(layout.dp), seq_len=SEQ_LEN)
                sim = simulate(schedule, hardware(), training=training)
                iteration = sim.iteration("canzona").iteration
                baselines = matrix_baselines(sim)
            else:
                sim = simulate(schedule, hardware())
            dp = schedule.metrics.dp
            points.append(AlphaPoint(alpha, sim.get("canzona").step, dp.gap, dp.max, schedule.tp.update))
    except PlanError as error:
        return Skipped(layout, str(error))
    return Planned(layout, tuple(points), iteration, tuple(baselines))


def alpha_findings(result: Planned) -> Iterator[Finding]:
    """(a) and (b) of one layout: at most one finding of each kind per larger α."""
    points = result.points
    for j, larger in enumerate(points):
        smaller = points[:j]
        slower = [p for p in smaller if larger.step > p.step * (1 + REL_TOL)]
        if slower:
            best = min(slower, key=lambda p: (p.step, p.alpha))
            yield Finding(
                OBJECTIVE,
                result.layout,
                f"alpha {best.alpha:g} -> {larger.alpha:g}",
                best.step,
                larger.step,
                larger.step / best.step,
            )
        tied = [
            p
            for p in smaller
            if abs(larger.step - p.step) <= REL_TOL * max(abs(larger.step), abs(p.step))
            and larger.gap > p.gap + GAP_TOL
        ]
        if tied:
            best = min(tied, key=lambda p: (p.gap, p.alpha))
            yield Finding(
                GAP_TIE,
                result.layout,
                f"alpha {best.alpha:g} -> {larger.alpha:g}",
                best.gap,
                larger.gap,
                larger.dp_max / best.dp_max if best.dp_max else float("inf"),
            )


def baseline_findings(result: Planned) -> Iterator[Finding]:
    """(c) of one layout: every matrix baseline faster than canzona at the default α, per measure."""
    canzona = next(p for p in result.points if p.alpha == DEFAULT_ALPHA)
    for kind, own, value_of in (
        (BASE_STEP, canzona.step, lambda b: b.step),
        (BASE_ITERATION, result.iteration, lambda b: b.iteration),
    ):
        for baseline in result.baselines:
            value = value_of(baseline)
            ratio = value / own if own else 1.0
            if ratio < 1 - REL_TOL:
                yield Finding(kind, result.layout, baseline.name, own, value, ratio)


def findings_of(results: Iterable[Outcome]) -> list[Finding]:
    """Every finding of every planned layout, in grid order (a, b, then c within a layout)."""
    found: list[Finding] = []
    for result in results:
        if isinstance(result, Planned):
            found.extend(alpha_findings(result))
            found.extend(baseline_findings(result))
    return found


def describe(finding: Finding) -> str:
    """One line of the offending-layout list."""
    if finding.kind == GAP_TIE:
        numbers = f"dp gap {finding.reference:.6%} -> {finding.other:.6%}  max DP load ratio {finding.ratio:.9f}"
    elif finding.kind == OBJECTIVE:
        numbers = f"step {finding.reference * 1e3:.9g} ms -> {finding.other * 1e3:.9g} ms  ratio {finding.ratio:.9f}"
    else:
        measure = "step" if finding.kind == BASE_STEP else "iteration"
        numbers = (
            f"{measure} canzona {finding.reference * 1e3:.9g} ms, {finding.what} {finding.other * 1e3:.9g} ms  "
            f"ratio {finding.ratio:.9f}"
        )
    return f"  {finding.layout.key:<32} {finding.what:<18} {numbers}"


def report(command: str, swept: str, results: Sequence[Outcome]) -> None:
    """Print the header, the table of counts and every offending layout."""
    planned = [r for r in results if isinstance(r, Planned)]
    skipped = [r for r in results if isinstance(r, Skipped)]
    found = findings_of(results)
    print("# objective sweep: the alpha ladder and the matrix baselines under the simulator\n")
    print(f"command: {command}")
    print(f"layouts: {swept}: {len(results)} swept, {len(planned)} planned, {len(skipped)} skipped (PlanError)")
    print(
        f"setup: {DEVICE}, ep 1, alpha ladder {' '.join(f'{a:g}' for a in ALPHAS)}; iteration at alpha "
        f"{DEFAULT_ALPHA:g} for global batch = the smallest multiple of dp >= {MIN_GLOBAL_BATCH}, seq len {SEQ_LEN}; "
        f"tolerance {REL_TOL:g} relative (DP gap: {GAP_TOL:g} absolute)\n"
    )
    print("| check | findings | layouts |")
    print("|---|---|---|")
    for kind in KINDS:
        of_kind = [f for f in found if f.kind == kind]
        print(f"| {KIND_TITLES[kind]} | {len(of_kind)} | {len({f.layout for f in of_kind})} of {len(planned)} |")
    replicated = [r for r in planned if any(p.alpha == DEFAULT_ALPHA and p.tp_update != "hosted" for p in r.points)]
    by_optimizer = ", ".join(f"{name} {sum(r.layout.optimizer == name for r in replicated)}" for name in OPTIMIZERS)
    print(f"\nplans at alpha {DEFAULT_ALPHA:g} with a replicated TP update: {len(replicated)} ({by_optimizer})")
    for kind in KINDS:
        of_kind = [f for f in found if f.kind == kind]
        print(f"\n## {KIND_TITLES[kind]}: {len(of_kind)}\n")
        for finding in of_kind:
            print(describe(finding))


CSV_COLUMNS = (
    "model",
    "tp",
    "dp",
    "optimizer",
    "alpha",
    "step_s",
    "dp_gap",
    "tp_update",
    "iteration_s",
    "baseline",
    "baseline_step_s",
    "baseline_iteration_s",
    "iteration_baseline",
    "iteration_baseline_s",
)


def save(results: Sequence[Outcome], path: str) -> None:
    """One CSV row per planned layout and α. At the default α also canzona's iteration, the
    matrix baseline with the smallest step (its step and iteration) and the one with the
    smallest iteration (its iteration); empty elsewhere."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for result in results:
            if not isinstance(result, Planned):
                continue
            layout = result.layout
            for point in result.points:
                extra: list[str] = [""] * 6
                if point.alpha == DEFAULT_ALPHA and result.baselines:
                    by_step = min(result.baselines, key=lambda b: b.step)
                    by_iteration = min(result.baselines, key=lambda b: b.iteration)
                    extra = [
                        repr(result.iteration),
                        by_step.name,
                        repr(by_step.step),
                        repr(by_step.iteration),
                        by_iteration.name,
                        repr(by_iteration.iteration),
                    ]
                writer.writerow(
                    [
                        layout.model,
                        layout.tp,
                        layout.dp,
                        layout.optimizer,
                        f"{point.alpha:g}",
                        repr(point.step),
                        repr(point.gap),
                        point.tp_update,
                        *extra,
                    ]
                )


def timed_sweep(layout: Layout) -> tuple[Outcome, float]:
    """`sweep_layout` and its wall time (s)."""
    began = time.perf_counter()
    outcome = sweep_layout(layout)
    return outcome, time.perf_counter() - began


def sweep(chosen: Sequence[Layout], workers: int) -> list[Outcome]:
    """Every layout's outcome, in the order given (in `workers` processes); progress on stderr."""
    results: list[Outcome] = []
    pool = multiprocessing.Pool(workers) if workers > 1 else None
    try:
        timed = pool.imap(timed_sweep, chosen, chunksize=1) if pool else map(timed_sweep, chosen)
        for number, (outcome, seconds) in enumerate(timed, 1):
            what = f"skipped: {outcome.reason}" if isinstance(outcome, Skipped) else "planned"
            print(
                f"[{number}/{len(chosen)}] {outcome.layout.key}: {what} ({seconds:.1f} s)", file=sys.stderr, flush=True
            )
            results.append(outcome)
    finally:
        if pool:
            pool.close()
            pool.join()
    return results


def main() -> None:
    """Sweep, print the counts and findings, optionally save the CSV."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the issue's whole grid (936 layouts)")
    parser.add_argument("--stride", type=int, default=STRIDE, help=f"subsample: every N-th layout (default {STRIDE})")
    parser.add_argument("--workers", type=int, default=1, help="processes planning layouts (default 1)")
    parser.add_argument("--save", help="write one row per layout and alpha to this CSV file")
    args = parser.parse_args()
    if args.workers < 1 or args.stride < 1:
        parser.error("--workers and --stride must be >= 1")
    started = time.perf_counter()
    chosen = layouts(args.full, args.stride)
    light = sum(layout.model not in HEAVY for layout in grid())
    swept = (
        f"the whole grid ({len(grid())})"
        if args.full
        else f"one in {args.stride} of the {light} layouts without {', '.join(HEAVY)}, plus the examples"
    )
    results = sweep(chosen, args.workers)
    report(shlex.join(["python", *sys.argv]), swept, results)
    if args.save:
        save(results, args.save)
    print(f"sweep time {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
