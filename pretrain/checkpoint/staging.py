"""The host copy an asynchronous checkpoint is written from (pretrain/checkpoint/async_save.py).

The state is copied into one flat host buffer, kept from one save to the next: a fresh buffer
costs its page faults (on this 2-core machine 2.7 s for 0.9 GB against 0.15 s to copy into one
already touched), which would otherwise fall on every save's stall. Each tensor gets a view of it
with a storage of its own, exactly its bytes (torch.frombuffer), so torch.save and DCP's writer
write each tensor alone, as from a tensor of its own (a view of a larger storage DCP would clone
first, and torch.save would write the whole storage). On a GPU the buffer is pinned by
registering it with CUDA (cudaHostRegister, as torch's own _create_cpu_state_dict pins): the
caching host allocator that pin_memory=True goes through rounds each allocation up to a power of
two (a 2.1 GB embedding would take 4 GiB) and keeps the memory after it is freed; a registered
buffer takes its exact size (what the plan's staged_bytes counts, pretrain/plan/checkpoint_memory.py)
and is unregistered and freed by close(). The copies are issued without blocking and synchronized
once before staging returns.

A DTensor (FSDP's shards) is staged as its local shard, wrapped again as a DTensor of the same
spec (mesh, placements, global shape) without moving it: DTensor.from_local would copy it back
to the mesh's device (a second GPU copy of the state, for the whole background write). Anything
but a tensor (the optimizer's hyperparameters) is kept as it is.

The buffer can be made ahead of the first save (reserve on the training thread, allocate in the
writer's thread), so that not even the first save pays for it. It serves DCP's asynchronous save
as its AsyncStager (stage, synchronize_staging, close) and the single-file format's writer directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

ALIGN = 64
"""Each tensor's offset in the flat buffer is a multiple of this (a cache line; any dtype's size)."""

Spec = tuple[str, torch.Size, torch.dtype]
"""A staged tensor: its path in the state, its shape, its dtype."""


class KeptBuffers(AsyncStager):
    """Stages a state (nested dicts, lists and tuples of tensors and plain values) into views of
    one flat host buffer, laid out by the path of each tensor in it."""

    _synchronize_after_execute = False  # stage() returns only once the copy is done

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        """Pin the buffer where the state is on a GPU (its copies then run without blocking)."""
        self._layout: list[Spec] = []
        self._views: dict[str, torch.Tensor] = {}
        self._flat: torch.Tensor | None = None
        self._registered: int | None = None
        """The data pointer registered with CUDA (pinned), None when none is."""
        self._cuda = False

    def stage(self, state_dict: Any, **_: Any) -> Any:
        if specs := self.reserve(state_dict):  # not made ahead, or the state changed shape
            self.allocate(specs)
        self._cuda = False
        with torch.no_grad():
            staged = self._copy(state_dict, "")
        if self._cuda:
            torch.cuda.synchronize()  # the copies were issued without blocking
        return staged

    def synchronize_staging(self) -> None:
        pass

    def reserve(self, state: Any) -> list[Spec]:
        """The layout stage(state) needs, every tensor's (path, shape, dtype), when it differs from
        the buffer's (else []): for allocate, which a thread may run while training goes on."""
        specs: list[Spec] = []

        def visit(value: Any, path: str) -> None:
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                specs.append((path, value.shape, value.dtype))
            elif isinstance(value, dict):
                for key, item in value.items():
                    visit(item, f"{path}/{key}")
            elif isinstance(value, list | tuple):
                for index, item in enumerate(value):
                    visit(item, f"{path}/{index}")

        visit(state, "")
        return [] if specs == self._layout else specs

    def allocate(self, specs: list[Spec]) -> None:
        """The buffer for the layout reserve gave, its pages touched (and pinned on a GPU): the
        first save then only copies. The previous buffer, if any, is released first."""
        self.close()
        offsets, total = [], 0
        for _path, shape, dtype in specs:
            offsets.append(total)
            total += -(-shape.numel() * dtype.itemsize // ALIGN) * ALIGN
        flat = torch.zeros(max(total, 1), dtype=torch.uint8)  # zeroed: every page touched now
        if self.pinned:
            pin_memory_utils.pin_memory(flat.data_ptr(), flat.numel())
            self._registered = flat.data_ptr()
        array = flat.numpy()
        for (path, shape, dtype), offset in zip(specs, offsets, strict=True):
            count = shape.numel()
            view = torch.frombuffer(array, dtype=dtype, count=count, offset=offset) if count else torch.empty(0, dtype=dtype)
            self._views[path] = view.view(shape)
        self._flat, self._layout = flat, list(specs)

    def close(self) -> None:
        """Release the buffer: unpinned and back to the allocator (and the OS) once nothing staged
        from it is referenced any more."""
        if self._registered is not None:
            pin_memory_utils.unpin_memory(self._registered)
            self._registered = None
        self._views.clear()
        self._layout = []
        self._flat = None

    @property
    def nbytes(self) -> int:
        """Host memory the buffer takes (each tensor's bytes, aligned to ALIGN)."""
        return 0 if self._flat is None else self._flat.numel()

    def _copy(self, value: Any, path: str) -> Any:
        if isinstance(value, DTensor):
            local = self._tensor(value.to_local(), path)
            return DTensor(local, value._spec, requires_grad=False)  # stays on the host (see the module's docstring)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, dict):
            return {key: self._copy(item, f"{path}/{key}") for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy(item, f"{path}/{index}") for index, item in enumerate(value))
        return value

    def _tensor(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._views[path]
        blocking = tensor.device.type != "cuda" or self._registered is None
        self._cuda |= not blocking
        buffer.copy_(tensor, non_blocking=not blocking)
        return buffer
