"""Row blocks: how a matrix is split into the submatrices the optimizer updates separately,
one definition that the planner's model sources build them by and the schedule validator
re-derives them with.

A matrix's row blocks list, per submatrix, the [start, stop) row ranges of the *gathered*
matrix (TP shards concatenated along `tp_dim`) whose concatenation is that submatrix. The
forms canzona writes:

- **fused** (fc1's [gate; up], a parameter list's `fused: N`): each TP shard holds N equal row
  parts, so the gathered rows interleave them (`fused_row_blocks`);
- **grouped QKV** (Megatron's `linear_qkv`): rows grouped per KV group as [q heads, k, v]
  (`qkv_row_blocks`), split into Q, K, V or into heads;
- **heads** (transformers' and torchtitan's q/k/v projections under `--split-qkv head`);
- **consecutive** (a parameter list's `submatrices`): consecutive single ranges.

Whether the request's split options decide a matrix's blocks depends on where its parameters
came from: a preset, or a Hugging Face config under transformers' or torchtitan's names, is
expanded by canzona from its architecture, so the blocks follow from the parameter's name, its
shape, the TP size and `split_qkv` / `split_fc1` (`row_blocks_problem`); a parameter list or a
live model describes its own splits, so there the blocks must have one of the forms above.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

Range = tuple[int, int]
Blocks = tuple[tuple[Range, ...], ...]


def fused_row_blocks(rows: int, parts: int, tp: int, split: bool) -> Blocks:
    """Row blocks of a matrix fused from `parts` equal row parts (fc1: gate, up) whose TP
    shards each hold [part 0 shard; part 1 shard; ...]: in gathered rows the parts interleave.

    `split`: one submatrix per part; else one submatrix in canonical order (part 0 then part
    1 ...), which is the gathered matrix itself only when tp == 1 (then no blocks are needed).
    """
    shard = rows // (parts * tp)
    per_rank = parts * shard
    blocks = tuple(
        tuple((rank * per_rank + part * shard, rank * per_rank + (part + 1) * shard) for rank in range(tp))
        for part in range(parts)
    )
    if split:
        return blocks
    return () if tp == 1 else (tuple(r for block in blocks for r in block),)


def qkv_row_blocks(groups: int, heads_per_group: int, head_dim: int, split: str) -> Blocks:
    """Megatron groups QKV rows per KV group as [q heads, k, v]; TP shards split on groups, so
    the gathered matrix is the canonical one. `split`: "qkv" (Q, K, V), "head" (every head),
    or "none" (no blocks)."""
    d, stride = head_dim, (heads_per_group + 2) * head_dim
    starts = [group * stride for group in range(groups)]
    k_rows = tuple((s + heads_per_group * d, s + (heads_per_group + 1) * d) for s in starts)
    v_rows = tuple((start + d, stop + d) for start, stop in k_rows)
    if split == "qkv":
        return (tuple((s, s + heads_per_group * d) for s in starts), k_rows, v_rows)
    if split == "head":
        q_heads = tuple(((s + j * d, s + (j + 1) * d),) for s in starts for j in range(heads_per_group))
        return q_heads + tuple((r,) for r in k_rows) + tuple((r,) for r in v_rows)
    return ()


def head_row_blocks(rows: int, head_dim: int) -> Blocks:
    """One block per head of a [heads x head_dim, cols] projection (none for a single head)."""
    heads = rows // head_dim
    return () if heads == 1 else tuple(((h * head_dim, (h + 1) * head_dim),) for h in range(heads))


def as_blocks(row_blocks: Sequence[Sequence[Sequence[int]]] | None) -> Blocks:
    """A file's row blocks (lists) as tuples; () for none."""
    return tuple(tuple((r[0], r[1]) for r in block) for block in row_blocks) if row_blocks else ()


def submatrices(shape: Sequence[int], blocks: Blocks) -> list[tuple[int, int]]:
    """The (rows, cols) of each submatrix a matrix of `shape` with `blocks` is updated as."""
    if not blocks:
        return [(shape[0], shape[1])]
    return [(sum(stop - start for start, stop in block), shape[1]) for block in blocks]


def _fused_form(blocks: Blocks, rows: int, shards: int) -> bool | None:
    """The `split` of `blocks` if they are fused_row_blocks(rows, parts, shards, split) for
    some parts >= 2, else None."""
    if len(blocks) > 1:
        parts, split = len(blocks), True
    elif shards > 1 and len(blocks[0]) % shards == 0:
        parts, split = len(blocks[0]) // shards, False
    else:
        return None
    if parts < 2 or rows % (parts * shards):
        return None
    return split if fused_row_blocks(rows, parts, shards, split) == blocks else None


def _qkv_form(blocks: Blocks, rows: int, split: str) -> tuple[int, int, int] | None:
    """(groups, heads per group, head dim) if `blocks` are qkv_row_blocks of them under
    `split`, else None."""
    if split == "qkv" and len(blocks) == 3:
        d, q_rows = blocks[1][0][1] - blocks[1][0][0], blocks[0][0][1] - blocks[0][0][0]
        groups, heads = len(blocks[1]), q_rows // d if d > 0 else 0
    elif split == "head" and all(len(block) == 1 for block in blocks):
        d = blocks[0][0][1] - blocks[0][0][0]
        breaks = (j for j, block in enumerate(blocks) if block[0][0] != j * d)
        heads = next(breaks, len(blocks) - 2)
        groups = len(blocks) // (heads + 2) if heads >= 1 else 0
    else:
        return None
    if d < 1 or heads < 1 or groups < 1 or groups * (heads + 2) * d != rows:
        return None
    return (groups, heads, d) if qkv_row_blocks(groups, heads, d, split) == blocks else None


def _head_form(blocks: Blocks, rows: int) -> bool:
    d = blocks[0][0][1] - blocks[0][0][0]
    return d >= 1 and rows % d == 0 and head_row_blocks(rows, d) == blocks


def _consecutive(blocks: Blocks) -> bool:
    return all(len(block) == 1 for block in blocks) and all(
        blocks[i][0][1] == blocks[i + 1][0][0] for i in range(len(blocks) - 1)
    )


_MEGATRON_FC1 = re.compile(r"(?:^|\.)linear_fc1\.weight\d*$")
_FC1 = {
    "megatron": _MEGATRON_FC1,
    "megatron-local": _MEGATRON_FC1,
    "hf": re.compile(r"(?:^|\.)mlp\.experts\.gate_up_proj\[\d+\]$"),
}
# a fused QKV weight (rows grouped per KV head as [q heads, k, v]) and the output projection
# whose input columns are its query rows, by naming convention
_QKV = {
    "megatron": ("linear_qkv.weight", "linear_proj.weight"),
    "megatron-local": ("linear_qkv.weight", "linear_proj.weight"),
    "torchtitan": ("qkv_linear.wqkv.weight", "wo.weight"),
}
_PROJECTIONS = {
    "hf": re.compile(r"(?:^|\.)self_attn\.[qkv]_proj\.weight$"),
    "torchtitan": re.compile(r"(?:^|\.)attention\.qkv_linear\.w[qkv]\.weight$"),
}  # fuse_qkv=False
Lookup = Callable[[str], "Sequence[int] | None"]


def expanded_by_canzona(source: str, sha256: str | None, names: str) -> bool:
    """Whether canzona expanded the model's parameters from an architecture (a preset, or a
    Hugging Face config under transformers' or torchtitan's names), so that the request's split
    options decide every matrix's row blocks."""
    return (sha256 is None and not source.startswith("py:")) or names != "megatron"  # a list records megatron


def _kind(name: str, names: str) -> str:
    """Which of canzona's splits a parameter of the `names` convention is subject to."""
    fc1 = _FC1.get(names)
    if fc1 is not None and fc1.search(name):
        return "fc1"
    fused = _QKV.get(names)
    if fused is not None and (name == fused[0] or name.endswith("." + fused[0])):
        return "qkv"
    projection = _PROJECTIONS.get(names)
    return "projection" if projection is not None and projection.search(name) else "other"


def _derived(kind: str, rows: int, blocks: Blocks, tp: int, split_qkv: str, split_fc1: bool) -> tuple[str | None, int]:
    """(why `blocks` are not what the split options give a matrix of this kind, the query rows
    of a grouped QKV matrix or 0)."""
    if kind == "fc1":
        wanted = fused_row_blocks(rows, 2, tp, split_fc1)
        return (None if blocks == wanted else f"split_fc1 {str(split_fc1).lower()} gives it {_spell(wanted)}"), 0
    if kind == "qkv" and split_qkv != "none":
        form = _qkv_form(blocks, rows, split_qkv) if blocks else None
        if form is None:
            return f"split_qkv {split_qkv} gives it Megatron's grouped Q, K, V blocks", 0
        return None, form[0] * form[1] * form[2]
    if kind == "projection" and split_qkv == "head":
        return (None if not blocks or _head_form(blocks, rows) else "split_qkv head gives it one block per head"), 0
    return (None if not blocks else f"split_qkv {split_qkv} and split_fc1 {str(split_fc1).lower()} give it none"), 0


def derived_problem(
    name: str,
    shape: Sequence[int],
    blocks: Blocks,
    tp: int,
    names: str,
    split_qkv: str,
    split_fc1: bool,
    shape_of: Lookup,
    cache: dict[tuple[Any, ...], Any],
) -> str | None:
    """Why `blocks` are not what `split_qkv` / `split_fc1` give the matrix `name` of `shape`
    (a parameter canzona expanded under the `names` convention at TP size `tp`), or None.
    `shape_of` finds another parameter's shape (a grouped QKV matrix's query rows are its
    layer's linear_proj's input columns); `cache` keeps verdicts on equal matrices."""
    kind = _kind(name, names)
    key = (kind, shape[0], blocks)
    if key not in cache:
        cache[key] = _derived(kind, shape[0], blocks, tp, split_qkv, split_fc1)
    problem, query_rows = cache[key]
    if problem or not query_rows:
        return problem
    qkv, proj = _QKV[names]
    output = shape_of(name[: -len(qkv)] + proj)
    if output is not None and (len(output) != 2 or output[1] != query_rows):
        return f"its query rows ({query_rows}) are not the input columns of its linear_proj"
    return None


def listed_problem(blocks: Blocks, rows: int, shards: int, split_qkv: str, live: bool, split_fc1: bool) -> str | None:
    """Why `blocks` (of a parameter a parameter list or a live model describes, whose TP shards
    along dim 0 are `shards`) have none of the forms canzona writes, or None. A live model's
    fused matrices are split exactly when `split_fc1` is set, and its fused QKV weights as
    `split_qkv` says."""
    if not blocks:
        return None
    if _qkv_form(blocks, rows, split_qkv) is not None:
        return None
    split = _fused_form(blocks, rows, shards)
    if live:
        return (
            None
            if split is not None and split == split_fc1
            else (
                f"a live model's fused matrix, which split_fc1 {str(split_fc1).lower()} splits "
                f"{'into its parts' if split_fc1 else 'into none'}, or fused QKV weight, which split_qkv "
                f"{split_qkv} splits {'into none' if split_qkv == 'none' else 'into grouped Q, K, V blocks'}"
            )
        )
    if split is not None or _consecutive(blocks):
        return None
    return "not a form canzona writes (fused parts, grouped Q/K/V, or consecutive submatrices)"


def _spell(blocks: Blocks) -> str:
    if not blocks:
        return "no row blocks"
    return (
        f"{len(blocks)} row block{'s' if len(blocks) > 1 else ''} of {', '.join(str(len(b)) for b in blocks[:4])}"
        + (" ..." if len(blocks) > 4 else "")
        + " ranges"
    )
