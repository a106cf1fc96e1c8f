"""canzona against Megatron-core's Muon on a live megatron-core `GPTModel`: the parity table.

Run:  python benchmarks/megatron_parity.py            (about a minute: 9 runs on up to 4 gloo ranks)
      python benchmarks/megatron_parity.py --write    (and put the table into BENCHMARKS.md)

The setting is tests/runtime/test_runtime_megatron.py's: examples/megatron_gpt.py's tiny Qwen3-like
`GPTModel` (Megatron's local layer spec; ColumnParallelLinear / RowParallelLinear at TP 2),
planned by `canzona plan --model py:examples/megatron_gpt.py:...`, trained 3 steps with
`CanzonaOptimizer` configured from Megatron's `OptimizerConfig`
(`canzona.runtime.integrations.megatron`), and on the same gradients Megatron's Muon
(tests/runtime/megatron_oracle.py) as:

- `formula`: Megatron-core 0.16's Muon written from its semantics, fp32;
- `fp64`: the same in fp64 (what fp32 rounding alone amounts to: the yardstick);
- `megatron-core`: megatron-core's own `TensorParallelMuon`, where it imports (it needs
  NVIDIA's `emerging_optimizers`, not on the package index).

Each cell is max over parameters of max |canzona − oracle| / max |oracle − initial| (the
update-relative error; `fp32 oracle vs fp64` is the formula's own distance from fp64). The
mismatch rows configure canzona otherwise than Megatron, as a user who switches optimizers
without the mapping would (each is what one mapping entry exists for).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))  # the tests' oracle and harness
sys.path.insert(0, str(Path(__file__).parent))

from megatron_oracle import megatron_muon_available, parity_error, run_parity_runs  # noqa: E402

QUINTIC = ("--ns-coefficients", "quintic")
# (case, tp, dp, plan flags, canzona's Megatron config, the oracle's on top of it)
CASES: list[tuple[str, int, int, tuple[str, ...], dict[str, Any], dict[str, Any]]] = [
    ("Megatron's defaults (quintic, split QKV)", 1, 1, QUINTIC, {}, {}),
    ("Megatron's defaults (quintic, split QKV)", 1, 2, QUINTIC, {}, {}),
    ("Megatron's defaults (quintic, split QKV)", 2, 1, QUINTIC, {}, {}),
    ("Megatron's defaults (quintic, split QKV)", 2, 2, QUINTIC, {}, {}),
    (
        "canzona's default plan; simple, Nesterov, wd 0.1",
        2,
        2,
        (),
        {"muon_coefficient_type": "simple", "muon_use_nesterov": True, "weight_decay": 0.1},
        {},
    ),
    (
        "mismatch: QKV whole (--split-qkv none)",
        1,
        1,
        QUINTIC + ("--split-qkv", "none"),
        {"muon_split_qkv": False},
        {"muon_split_qkv": True},
    ),
    (
        "mismatch: simple coefficients",
        1,
        1,
        (),
        {"muon_coefficient_type": "simple"},
        {"muon_coefficient_type": "quintic"},
    ),
    ("mismatch: Nesterov on", 1, 1, QUINTIC, {"muon_use_nesterov": True}, {"muon_use_nesterov": False}),
    (
        "mismatch: canzona's 0.2 spectral scale",
        1,
        1,
        QUINTIC,
        {"muon_extra_scale_factor": 0.2},
        {"muon_extra_scale_factor": 1.0},
    ),
    ("Megatron's blockwise TP mode (refused)", 2, 1, QUINTIC, {}, {"muon_tp_mode": "blockwise"}),
]


def measure(tmp: Path, backends: tuple[str, ...]) -> list[list[str]]:
    """One row per case: its layout and the errors against each oracle."""
    rows = []
    for case, tp, dp, flags, ours, theirs in CASES:
        chosen = tuple(b for b in backends if not (theirs.get("muon_tp_mode") == "blockwise" and b == "megatron"))
        result = run_parity_runs(tmp, tp, dp, flags, ours, chosen, theirs)
        refs, initial = result["references"], result["initial"]
        blockwise = theirs.get("muon_tp_mode") == "blockwise"  # megatron-core's own needs a real TP group for it
        cells = [
            "-" if blockwise and b == "megatron" else f"{parity_error(result['canzona'], refs[b], initial)[0]:.1e}"
            for b in backends
        ]
        own = parity_error(refs["formula"], refs["formula64"], initial)[0]
        rows.append([case, f"tp{tp} dp{dp}", *cells, f"{own:.1e}"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def table(rows: list[list[str]], backends: tuple[str, ...]) -> str:
    """The markdown table."""
    names = {"formula": "vs formula (fp32)", "formula64": "vs fp64", "megatron": "vs megatron-core's Muon"}
    header = ["case", "layout", *(names[b] for b in backends), "fp32 oracle vs fp64"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="put the table into BENCHMARKS.md")
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    backends = ("formula", "formula64") + (("megatron",) if megatron_muon_available() else ())
    with tempfile.TemporaryDirectory() as folder:
        text = table(measure(Path(folder), backends), backends)
    if "megatron" not in backends:
        text += "\n\nmegatron-core's own Muon did not import here (emerging_optimizers is not installed)."
    print(text)
    if arguments.write:
        from bench_md import write_section

        write_section(
            ROOT / "BENCHMARKS.md", "## Megatron-core parity", text, "python benchmarks/megatron_parity.py --write"
        )


if __name__ == "__main__":
    main()
