"""The sharded (FSDP) part of a checkpoint, <checkpoint>/dcp/: torch.distributed.checkpoint
files, written as DCP does and read without running code the files could name.

DCP pickles two things: its metadata (.metadata), and every value that is not a tensor, which
it stores as bytes and reads back with torch.load(weights_only=False). A crafted checkpoint
could use either to run code on resume. So the metadata is unpickled admitting only DCP's own
metadata classes, and since this code stores nothing but tensors in DCP, a checkpoint that
declares any pickled value is refused before anything is read; the reader and the planner
refuse such a value too, should one reach them anyway.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from pretrain.checkpoint.files import CheckpointError, first_line

DIRECTORY = "dcp"

# Unpickling runs whatever the file names, so only the classes DCP's own metadata is made of
# are admitted.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint path (its dcp/.metadata), read without running foreign
    code; CheckpointError when it declares anything but tensors in files of dcp/."""
    file = path / DIRECTORY / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: dcp/.metadata is missing; use another checkpoint of the run")
    try:
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {path}: cannot read dcp/.metadata ({first_line(error)}); use another checkpoint of the run"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path}: dcp/.metadata is not DCP metadata; use another checkpoint")
    _check_tensors_only(path, metadata)
    _check_files_inside(path, metadata)
    return metadata


def _check_tensors_only(path: Path, metadata: Metadata) -> None:
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            kind = "pickled bytes" if isinstance(item, BytesStorageMetadata) else type(item).__name__
            raise CheckpointError(
                f"checkpoint {path}: dcp/.metadata declares {key} as {kind}, which this code never "
                "writes (only tensors) and will not unpickle; use another checkpoint of the run"
            )


def _check_files_inside(path: Path, metadata: Metadata) -> None:
    """Every shard is a file directly in dcp/: a name like ../../x would read elsewhere."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise CheckpointError(
                f"checkpoint {path}: dcp/.metadata names the file {name!r}, not one in dcp/; use another checkpoint of the run"
            )


def tensor_entries(metadata: Metadata, prefix: str) -> dict[str, TensorStorageMetadata]:
    """The tensors whose keys start with prefix ("model."), keyed without it."""
    return {
        key.removeprefix(prefix): item
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


def _refuse_bytes(what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {what}: a DCP entry is pickled bytes, which this code never writes (only "
        "tensors) and will not unpickle; use another checkpoint of the run"
    )


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata goes through read_dcp_metadata instead of pickle.load,
    and which reads tensors only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self.checkpoint_id).parent)  # the reader is given <checkpoint>/dcp
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise _refuse_bytes(str(Path(self.checkpoint_id).parent))
        return super().read_data(plan, planner)


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that it never unpickles a value (DefaultLoadPlanner.load_bytes
    calls torch.load(weights_only=False))."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise _refuse_bytes(f"entry {read_item.dest_index.fqn}")


def dcp_load(state: dict[str, Any], path: Path, alone: bool | None = None) -> None:
    """dcp.load of checkpoint path's dcp/ into state, in place; alone (default: when there is
    no process group) reads every tensor in this process, without a collective."""
    if alone is None:
        alone = not (dist.is_available() and dist.is_initialized())
    with _one_line_errors(f"checkpoint {path}: cannot read dcp/", "use another checkpoint of the run"):
        with warnings.catch_warnings():  # it warns whenever it runs alone, even when asked to
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=SafeReader(path / DIRECTORY), planner=TensorsOnlyPlanner(), no_dist=alone)


def dcp_save(content: dict[str, Any], directory: Path) -> None:
    """dcp.save of content into directory: every rank writes (and fsyncs) its own shards, rank 0
    the metadata last. A collective."""
    with _one_line_errors(
        f"cannot write the sharded checkpoint {directory}",
        "check that its disk has space and is writable, then resume from the latest checkpoint",
    ):
        dcp.save(content, storage_writer=FileSystemWriter(directory))


def dcp_async_save(content: dict[str, Any], directory: Path, group: dist.ProcessGroup | None, stager: AsyncStager) -> Future:
    """dcp.async_save of content into directory: stager copies this rank's shards to host memory
    before it returns (the only time the caller blocks), then a thread of DCP's writes them as
    dcp_save does, its collectives on group (a gloo group of its own, so that they never
    interleave with training's on the default one). The future's error: save_error."""
    with warnings.catch_warnings():  # experimental, it says
        warnings.simplefilter("ignore", FutureWarning)
        response = dcp.async_save(
            content,
            storage_writer=FileSystemWriter(directory),
            process_group=group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=stager,
        )
    if isinstance(response, AsyncSaveResponse):  # a stager that stages in the background; ours does not
        return response.upload_completion
    return response


def save_error(error: BaseException, directory: Path) -> BaseException:
    """A failure of dcp_async_save's future as dcp_save would have raised it: DCP's as one line
    (CheckpointError), anything else (a lost peer's) as it is."""
    if not isinstance(error, CheckpointException):
        return error
    try:
        with _one_line_errors(
            f"cannot write the sharded checkpoint {directory}",
            "check that its disk has space and is writable, then resume from the latest checkpoint",
        ):
            raise error
    except CheckpointError as converted:
        return converted
    raise AssertionError("_one_line_errors converts every CheckpointException")


@contextmanager
def _one_line_errors(what: str, fix: str) -> Iterator[None]:
    """DCP reports any rank's failure as a CheckpointException (a BaseException, with every
    rank's traceback in its message): re-raise a CheckpointError as it was, anything else as
    a one-line CheckpointError."""
    try:
        yield
    except CheckpointException as error:
        causes = [cause for cause, _trace in error.failures.values()]
        for cause in causes:
            if isinstance(cause, CheckpointError):
                raise cause from None
        reason = first_line(causes[0]) if causes else "failed"
        raise CheckpointError(f"{what} ({reason}); {fix}") from None
