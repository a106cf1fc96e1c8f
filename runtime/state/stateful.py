"""canzona's optimizer state for checkpointers built on torch.distributed.checkpoint (DCP), such as
torchtitan's `CheckpointManager` or a script's own `dcp.save` / `dcp.load`.

`DcpState(optimizer)` is a DCP `Stateful`: its `state_dict()` holds the optimizer's logical state
(`canzona.runtime.state.logical`) as one tensor per logical key, each carrying the chunks this
rank holds at their offsets in the full tensor, and the rest of the record (steps,
hyperparameters, state layout) as one JSON string. DCP writes one copy of every chunk, whatever
the rank layout, and on load reads into each rank's chunks whatever overlaps them in the
checkpoint, so a checkpoint moves between schedules of the same model as `save_checkpoint`'s
do. `load_state_dict` then restores the state through the optimizer's own `load_state_dict`,
which checks the model and the groups first and changes nothing on a mismatch.

A chunk tensor (`LogicalChunks`) is a tensor of the full logical shape that owns no storage; it
answers DCP's checkpointing protocol (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`) and nothing else: every other operation on it raises.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from canzona.runtime.state.logical import LogicalTensor, layout_sizes

RECORD, TENSORS = "record", "tensors"


class LogicalChunks(torch.Tensor):
    """One logical state tensor as DCP sees it: the full `size`, the chunks this rank holds, and
    which of them this rank writes (one copy of each replica)."""

    logical: LogicalTensor
    written: frozenset[tuple[int, ...]]
    handled: ClassVar[frozenset[str]] = frozenset()

    @staticmethod
    def __new__(cls, logical: LogicalTensor, written: frozenset[tuple[int, ...]]) -> LogicalChunks:
        first = logical.chunks[0][1] if logical.chunks else torch.empty(0, device="cpu")
        made = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(logical.size), dtype=first.dtype, device=first.device
        )
        made.logical, made.written = logical, written
        return made

    # torch's stubs declare Tensor.__torch_dispatch__ a plain function; subclasses override it as a
    # classmethod, torch's documented pattern (DTensor's too)
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise TypeError(f"a canzona state chunk list is for checkpointing only ({func} is not supported on it)")

    # mypy rejects any override of Tensor.__repr__, even one with Tensor's own signature
    def __repr__(self) -> str:  # type: ignore[override]
        return f"LogicalChunks(size={list(self.logical.size)}, chunks={len(self.logical.chunks)})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """One shard write item per chunk this rank writes."""
        size = torch.Size(self.logical.size)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    ChunkStorageMetadata(torch.Size(offsets), data.size()),
                    TensorProperties.create_from_tensor(data),
                    size,
                ),
            )
            for offsets, data in self.logical.chunks
            if offsets in self.written
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """Every chunk this rank holds (what a load fills)."""
        return [ChunkStorageMetadata(torch.Size(offsets), data.size()) for offsets, data in self.logical.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The chunk at `index`'s offsets."""
        for offsets, data in self.logical.chunks:
            if index.offset is not None and torch.Size(offsets) == index.offset:
                return data
        raise ValueError(f"no chunk of {index.fqn} at offsets {index.offset}")


class DcpState:
    """`optimizer` (a `CanzonaOptimizer` or `FsdpOptimizer`) as a DCP `Stateful` (module docstring)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """Every logical tensor this rank can hold (copies of its state) and the record, for DCP
        to save or to fill (collective: stale main copies are rebuilt first). DCP loads only what
        a state dict names, so it names what the state layout allows, whatever this state holds
        yet: tensors that do not exist before a first step (SOAP's eigenbases) are zeros, which
        a first step recomputes."""
        optimizer = self.optimizer
        optimizer.refresh_main_copies()
        held = optimizer.export_logical(writers_only=False, clone=True)
        writers = {
            key: frozenset(offsets for offsets, _ in tensor.chunks)
            for key, tensor in optimizer.export_logical(writers_only=True, clone=False).items()
        }
        absent = {key: size for key, size in layout_sizes(optimizer.state_layout()).items() if key not in held}
        if absent:
            planned = optimizer.logical_destination({**{key: t.size for key, t in held.items()}, **absent}).tensors
            for key in absent.keys() & planned.keys():
                held[key] = LogicalTensor(
                    planned[key].size, [(offsets, data.zero_()) for offsets, data in planned[key].chunks]
                )
                writers[key] = frozenset(offsets for offsets, _ in planned[key].chunks)
        tensors = {key: LogicalChunks(tensor, writers.get(key, frozenset())) for key, tensor in held.items()}
        record = {key: value for key, value in optimizer.logical_record().items() if key != TENSORS}
        return {RECORD: json.dumps(record, sort_keys=True), TENSORS: tensors}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what DCP read into `state_dict()`'s chunks (ValueError, nothing changed, when
        it is another model's state)."""
        record = state_dict.get(RECORD)
        tensors = state_dict.get(TENSORS)
        if not isinstance(record, str) or not isinstance(tensors, dict):
            raise ValueError("not a canzona optimizer state saved through DcpState (no record and tensors)")
        logical = {key: value.logical if isinstance(value, LogicalChunks) else value for key, value in tensors.items()}
        self.optimizer.load_state_dict({**json.loads(record), TENSORS: logical})
