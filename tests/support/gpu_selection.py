"""GPUs described directly and claims kept in a dictionary, for the tests of GPU selection
(tests/launcher/gpus/test_devices.py, tests/launcher/gpus/test_gpu_visibility_limits.py). gpu() makes NVIDIA GPUs, or the
`vendor` fixture's in a test that takes it (the made_by fixture, imported by those modules)."""

from __future__ import annotations

import pytest

from launcher.gpus import claims, selection as devices
from launcher.gpus.devices import Gpu, Health
from launcher.gpus.request import Criteria, parse_request
from launcher.gpus.selection import select

GIB = 1 << 30
MADE = {"vendor": "nvidia"}
"""Whose GPUs gpu() makes: the `vendor` fixture's where a test takes it."""
NAMES = {"nvidia": "NVIDIA H100 80GB HBM3", "amd": "AMD Instinct MI300X"}
HEALTHY = Health(
    ecc_uncorrected=0,
    retired_pages_pending=False,
    remapping_pending=False,
    remapping_failed=False,
    clock_reasons=frozenset({"gpu_idle"}),
    pcie_width=16,
    pcie_max_width=16,
)


def gpu(
    index: int,
    util: float | None = 0.0,
    used_gib: float = 0.0,
    total_gib: float = 80.0,
    *,
    mig_of: int | None = None,
    mig_enabled: bool = False,
    processes=(),
    health: Health = HEALTHY,
) -> Gpu:
    """A GPU, a MIG device of GPU mig_of (on AMD: a partition of it), or a GPU in MIG mode (AMD:
    in a partition mode), made by MADE's vendor."""
    vendor = MADE["vendor"]
    gpu_id = f"{mig_of}.{index}" if mig_of is not None else str(index)
    if mig_of is not None:
        uuid = f"MIG-{mig_of}{index}aa" if vendor == "nvidia" else f"GPU-{mig_of}{index}aa0000"
    else:
        uuid = f"GPU-{index}{index}ff-0000"
    return Gpu(
        id=gpu_id,
        index=mig_of if mig_of is not None else index,
        uuid=uuid,
        name=NAMES[vendor],
        pci_bus_id=f"00000000:{index:02X}:00.0",
        memory_total=int(total_gib * GIB),
        memory_used=int(used_gib * GIB),
        utilization=util,
        processes=tuple(processes),
        mig=mig_of is not None,
        mig_enabled=mig_enabled,
        health=health,
        vendor=vendor,  # type: ignore[arg-type]
    )


@pytest.fixture(autouse=True)
def made_by(request, monkeypatch):
    """gpu() makes the `vendor` fixture's GPUs in a test that takes it, NVIDIA's in the others."""
    if "vendor" in request.fixturenames:
        monkeypatch.setitem(MADE, "vendor", request.getfixturevalue("vendor"))


class Claims:
    """Claims without files: uuid -> holder pid; a claim by this test takes pid 0."""

    def __init__(self, held: dict[str, int] | None = None) -> None:
        self.held = dict(held or {})
        self.released: list[str] = []

    def claim(self, uuid: str) -> claims.Claim | claims.Holder:
        if uuid in self.held:
            return claims.Holder(pid=self.held[uuid], user="bob", since="09:00")
        self.held[uuid] = 0
        test = self

        class Held(claims.Claim):
            def __init__(self, uuid: str) -> None:  # no socket: the dictionary is the claim
                self.uuid = uuid

            def release(self) -> None:
                test.released.append(self.uuid)
                test.held.pop(self.uuid, None)

        return Held(uuid)

    def holder(self, uuid: str) -> claims.Holder | None:
        pid = self.held.get(uuid)
        return None if pid is None else claims.Holder(pid=pid, user="bob", since="09:00")


def choose(
    gpus: list[Gpu],
    request: str,
    claimed: Claims | None = None,
    visible: str | devices.Limits | None = None,
    strict: bool = False,
    criteria: Criteria | None = None,
) -> devices.Selection:
    """visible: the launcher's own limiting variables, or CUDA_VISIBLE_DEVICES' value."""
    table = claimed or Claims()
    return select(
        gpus,
        parse_request(request),
        criteria or Criteria(),
        strict=strict,
        limits=visible,
        claim=table.claim,
        holder=table.holder,
    )


def ids(selection: devices.Selection) -> list[str]:
    return [g.id for g in selection.chosen]


def mig_machine() -> list[Gpu]:
    return [
        gpu(0, mig_enabled=True, util=None),
        gpu(0, util=None, total_gib=10, mig_of=0),
        gpu(1, util=None, total_gib=10, mig_of=0),
        gpu(1),
    ]
