"""Checkpoints of the logical optimizer state through torch.distributed.checkpoint (DCP).

A checkpoint is a folder shared by all ranks:

    CHECKPOINT.json      the commit record: which data folder, step, state layout, file checksums
    data-<step>-<id>/    DCP files (`.metadata`, `__<rank>_<n>.distcp`), never modified once written

Saving: each rank writes only the logical chunks it holds (one copy of each replica) into a new
data folder; the ranks checksum the files; then one rank atomically replaces CHECKPOINT.json
(temporary file, fsync, rename) and removes older data folders. A crash before that rename
leaves the previous checkpoint as it was. Loading: every rank checks the record (model, state
layout), verifies its share of the checksums, and reads the chunks it holds under its own
schedule: DCP reads them from whichever ranks wrote them (resharding). Every failure, on any
rank, raises the same `CheckpointError` on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from canzona.runtime.faults import CheckpointError, describe, gather_objects
from canzona.runtime.state.logical import STATE_FORMAT, Destination, LogicalTensor
from canzona.schedules.files import write_atomic
from canzona.schedules.reshard import StateLayout, incompatibilities

MANIFEST = "CHECKPOINT.json"
CHECKPOINT_FORMAT = "canzona-checkpoint/1"
DATA_PREFIX = "data-"
DCP_METADATA = ".metadata"


class Checkpointable(Protocol):
    """What a checkpoint needs of an optimizer (`CanzonaOptimizer` provides it)."""

    @property
    def dp_rank(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def step_count(self) -> int: ...
    @property
    def process_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]: ...

    def finish_gather(self) -> None: ...
    def state_layout(self) -> StateLayout: ...
    def logical_record(self) -> dict[str, Any]: ...
    def export_logical(self, writers_only: bool, clone: bool) -> dict[str, LogicalTensor]: ...
    def logical_destination(self, available: Any) -> Destination: ...
    def install_logical(self, dest: Destination, step: int, param_steps: Any) -> None: ...
    def check_saved_groups(self, saved: Any, saved_experts: Any = ()) -> list[dict[str, Any]] | None: ...
    def restore_groups(self, saved: list[dict[str, Any]] | None) -> None: ...


class _SavePlanner(DefaultSavePlanner):
    """DCP save planner for `LogicalTensor` values: one shard write item per chunk."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        """One write item per chunk of every `LogicalTensor` in the state dict."""
        self._chunks: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        items = []
        for key, tensor in self.state_dict.items():
            for offsets, data in tensor.chunks:
                self._chunks[(key, offsets)] = data
                chunk = ChunkStorageMetadata(torch.Size(offsets), data.size())
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk, TensorProperties.create_from_tensor(data), torch.Size(tensor.size)
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The chunk a write item names."""
        assert index.offset is not None
        return self._chunks[(index.fqn, tuple(index.offset))]


class _LoadPlanner(DefaultLoadPlanner):
    """DCP load planner for `LogicalTensor` destinations: reads every stored chunk that
    overlaps a destination chunk (regions the checkpoint lacks, e.g. new padded rows, stay)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        """Keep the destinations as they are (the default planner would flatten them)."""
        self.state_dict = self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """Read items for every stored chunk that overlaps a destination chunk."""
        assert self.metadata is not None
        items = []
        for key, tensor in self.state_dict.items():
            stored = self.metadata.state_dict_metadata.get(key)
            if not isinstance(stored, TensorStorageMetadata):
                raise ValueError(f"the checkpoint has no tensor {key!r}")
            chunks = [ChunkStorageMetadata(torch.Size(offsets), data.size()) for offsets, data in tensor.chunks]
            items += create_read_items_for_chunk_list(key, stored, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The destination chunk a read item names."""
        assert index.index is not None
        return self.state_dict[index.fqn].chunks[index.index][1]


def _grid_rank(opt: Checkpointable) -> int:
    return opt.dp_rank * opt.tp_size + opt.tp_rank


def _exchange(opt: Checkpointable, problem: str | None, payload: Any, what: str) -> list[Any]:
    """Every rank's payload (grid order); CheckpointError on every rank if any had a problem."""
    reports = gather_objects((dist.get_rank(), problem, payload), opt.process_groups, what)
    failed = [(rank, p) for rank, p, _ in reports if p]
    if failed:
        raise CheckpointError(f"canzona: {what} failed; " + describe(failed))
    return [payload for _, _, payload in reports]


def _one_line(error: BaseException) -> str:
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: exception}
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))
    lines = str(error).strip().splitlines()
    return (
        f"{type(error).__name__}: {lines[0] if lines else ''}" if not isinstance(error, CheckpointError) else lines[0]
    )


def _attempt(call: Any, *args: Any) -> tuple[Any, str | None]:
    """(result, None), or (None, the error as one line)."""
    try:
        return call(*args), None
    except Exception as error:
        return None, _one_line(error)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fsync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _commit(root: Path, manifest: dict[str, Any]) -> None:
    """Atomically make `manifest` the checkpoint record at `root` (`write_atomic`: temporary
    file, fsync, rename; then the folder is fsync'd so that the rename is durable)."""
    write_atomic(root / MANIFEST, json.dumps(dict(manifest, sha256=_body_digest(manifest)), indent=1, sort_keys=True))
    _fsync_folder(root)


def _remove_stale(root: Path, keep: str) -> None:
    """Best effort: data folders of older or unfinished saves."""
    for folder in root.glob(f"{DATA_PREFIX}*"):
        if folder.name != keep and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


def _check_group(opt: Checkpointable, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    group = group if group is not None else dist.group.WORLD
    assert group is not None, "torch.distributed is not initialised"
    if dist.get_world_size(group) != opt.dp_size * opt.tp_size:
        raise ValueError(
            f"the checkpoint process group has {dist.get_world_size(group)} ranks, "
            f"the optimizer runs on DP {opt.dp_size} x TP {opt.tp_size}"
        )
    return group


def _my_files(opt: Checkpointable, files: Sequence[str]) -> list[str]:
    world = opt.dp_size * opt.tp_size
    return [name for i, name in enumerate(files) if i % world == _grid_rank(opt)]


def _prepare_folder(root: Path, step: int) -> str:
    root.mkdir(parents=True, exist_ok=True)
    return f"{DATA_PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_json_value(item) for item in value]
    return value


def _manifest(opt: Checkpointable, folder: str, files: dict[str, str]) -> dict[str, Any]:
    record = opt.logical_record()
    groups = [{key: _json_value(value) for key, value in group.items()} for group in record["param_groups"]]
    return {
        "format": CHECKPOINT_FORMAT,
        "state_format": record["format"],
        "data": folder,
        "step": record["step"],
        "param_steps": record["param_steps"],
        "strategy": record["strategy"],
        "layout": record["layout"],
        "fingerprint": record["fingerprint"],
        "digest": record["digest"],
        "world": opt.dp_size * opt.tp_size,
        "hyperparameters": record["hyperparameters"],
        "param_groups": groups,
        "files": files,
        "ep_experts": record["ep_experts"],
    }


def _write(opt: Checkpointable, folder: Path, group: dist.ProcessGroup) -> dict[str, str]:
    """Write this rank's chunks with DCP; the checksums of this rank's share of the files."""
    chunks = opt.export_logical(writers_only=True, clone=False)
    writer = dcp.FileSystemWriter(folder, sync_files=True)
    metadata = dcp.save(chunks, storage_writer=writer, planner=_SavePlanner(), process_group=group)
    names = sorted({info.relative_path for info in metadata.storage_data.values()} | {DCP_METADATA})
    return {name: _sha256(folder / name) for name in _my_files(opt, names)}


def save_checkpoint(
    opt: Checkpointable, path: str | os.PathLike[str], *, process_group: dist.ProcessGroup | None = None
) -> Path:
    """Save `opt`'s logical state to the folder `path` (collective; every rank passes the same
    path on a shared file system). Atomic: until it returns, `path` holds the previous
    checkpoint. Returns the data folder written. CheckpointError on every rank on failure."""
    opt.finish_gather()
    root, group = Path(path), _check_group(opt, process_group)
    leader = _grid_rank(opt) == 0
    folder, problem = _attempt(_prepare_folder, root, opt.step_count) if leader else (None, None)
    folder = _exchange(opt, problem, folder, f"saving checkpoint {str(root)!r} (preparing the folder)")[0]
    sums, problem = _attempt(_write, opt, root / folder, group)
    shares = _exchange(opt, problem, sums, f"saving checkpoint {str(root)!r} (writing the state)")
    files = {name: digest for share in shares for name, digest in share.items()}
    problem = None
    if leader:
        _, problem = _attempt(_commit, root, _manifest(opt, folder, files))
        if problem is None:
            _remove_stale(root, folder)
    _exchange(opt, problem, None, f"saving checkpoint {str(root)!r} (committing)")
    return root / folder


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The commit record of the checkpoint at `path`; CheckpointError if there is none or it is
    damaged."""
    record = Path(path) / MANIFEST
    try:
        text = record.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"no committed checkpoint at {str(path)!r} ({MANIFEST} is missing)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"cannot read {str(record)!r}: {error}") from error
    try:
        body = json.loads(text)
        digest = body.pop("sha256")
    except (ValueError, AttributeError, KeyError, TypeError):
        raise CheckpointError(f"{str(record)!r} is corrupt (not a checkpoint record)") from None
    if digest != _body_digest(body):
        raise CheckpointError(f"{str(record)!r} is corrupt (checksum mismatch)")
    if body.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{str(record)!r} has format {body.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    return body


def _check_record(opt: Checkpointable, root: Path, param_groups: bool) -> dict[str, Any]:
    manifest = read_manifest(root)
    try:
        problems = incompatibilities(StateLayout.from_json(manifest["layout"]), opt.state_layout())
    except ValueError as error:
        raise CheckpointError(f"{str(root / MANIFEST)!r}: {error}") from error
    if problems:
        raise CheckpointError("the checkpoint does not fit this optimizer: " + "; ".join(problems))
    if param_groups:
        try:
            manifest["param_groups"] = opt.check_saved_groups(
                manifest.get("param_groups"), manifest.get("ep_experts", ())
            )
        except ValueError as error:
            raise CheckpointError(
                f"the checkpoint's param groups do not fit ({error}); load with param_groups=False "
                "to keep this optimizer's"
            ) from error
    return manifest


# What a DCP `.metadata` pickle may name: DCP's own metadata classes and what they hold. Anything
# else (a function to call, a class from elsewhere) means the file was not written by DCP.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: a `.metadata` file naming anything but DCP's
    metadata classes, torch sizes and dtypes is refused before any of it is built or called."""

    def find_class(self, module: str, name: str) -> Any:
        """The class `module.name` if DCP metadata may hold it; CheckpointError otherwise."""
        found = getattr(sys.modules.get(module), name, None)
        own = module == _METADATA_MODULE and isinstance(found, type) and found.__module__ == module
        dtype = module == "torch" and isinstance(found, torch.dtype)
        if own or dtype or name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(
            f"the checkpoint's DCP metadata names {module}.{name}, which DCP never writes: "
            "refusing to unpickle it (load checkpoints only from sources you trust)"
        )


class _SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with the metadata read by `_MetadataUnpickler` (DCP's own reader
    unpickles it unrestricted, which would run whatever a crafted file asks)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The folder's `.metadata`, unpickled under the allowlist."""
        with open(Path(self.path) / DCP_METADATA, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError("the checkpoint's DCP metadata is not DCP metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _verify(opt: Checkpointable, folder: Path, files: dict[str, str]) -> None:
    for name in _my_files(opt, sorted(files)):
        if not (folder / name).is_file():
            raise CheckpointError(f"checkpoint file {str(folder / name)!r} is missing")
        if _sha256(folder / name) != files[name]:
            raise CheckpointError(
                f"checkpoint file {str(folder / name)!r} is corrupt (sha256 mismatch: truncated or modified)"
            )


def _plan(opt: Checkpointable, folder: Path) -> Destination:
    stored = _SafeReader(folder).read_metadata().state_dict_metadata
    available = {key: tuple(md.size) for key, md in stored.items() if isinstance(md, TensorStorageMetadata)}
    return opt.logical_destination(available)


def load_checkpoint(
    opt: Checkpointable,
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    param_groups: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at `path` into `opt` (collective), whatever schedule of the same model
    saved it: every rank reads the state it holds under `opt`'s schedule (fp32 main copies
    included; a checkpoint without them has them rebuilt from the parameters at the next step).
    `param_groups` also restores every group's hyperparameters, as `load_state_dict` does.
    `verify` checks the files' checksums first (each rank reads a share). Returns the commit
    record. On any problem every rank raises CheckpointError and `opt` is unchanged."""
    opt.finish_gather()
    root, group = Path(path), _check_group(opt, process_group)
    what = f"loading checkpoint {str(root)!r}"
    manifest, problem = _attempt(_check_record, opt, root, param_groups)
    if manifest is not None and verify:
        _, problem = _attempt(_verify, opt, root / manifest["data"], manifest["files"])
    _exchange(opt, problem, None, what)
    assert manifest is not None
    folder = root / manifest["data"]
    dest, problem = _attempt(_plan, opt, folder)
    _exchange(opt, problem, None, what)
    reader = _SafeReader(folder)
    _, problem = _attempt(
        lambda: dcp.load(dest.tensors, storage_reader=reader, planner=_LoadPlanner(), process_group=group)
    )
    _exchange(opt, problem, None, what)
    opt.install_logical(dest, int(manifest["step"]), manifest.get("param_steps", {}))
    if param_groups:
        opt.restore_groups(manifest.get("param_groups"))
    return manifest


def merge_state_dicts(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One logical state from several ranks' `state_dict()`s (e.g. gathered to one process):
    their chunks side by side; any optimizer of the model can load what it needs from it."""
    if not states:
        raise ValueError("nothing to merge")
    merged = dict(states[0], tensors={})
    for state in states:
        if (
            state.get("format") != STATE_FORMAT
            or state["layout"] != states[0]["layout"]
            or state["step"] != states[0]["step"]
        ):
            raise ValueError("the state dicts come from different models, formats or steps")
        for key, tensor in state["tensors"].items():
            merged["tensors"].setdefault(key, LogicalTensor(tensor.size)).chunks.extend(tensor.chunks)
    return merged
