"""Atomic writes: a reader sees the old file or the whole new one, and the new one is shareable."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pretrain.run.files import atomic_write, atomic_write_text, os_error_message


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_written_file_has_the_whole_text_and_is_readable_by_others(tmp_path):
    path = tmp_path / "deeper" / "state.json"  # missing directories are created
    atomic_write_text(path, "first\n")
    atomic_write_text(path, "second, longer\n")
    assert path.read_text() == "second, longer\n"
    assert mode(path) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]  # no temporary file left


def test_the_mode_can_be_chosen(tmp_path):
    atomic_write(tmp_path / "private", lambda tmp: tmp.write_bytes(b"secret"), mode=0o600)
    assert mode(tmp_path / "private") == 0o600


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "model.bin"
    atomic_write(path, lambda tmp: tmp.write_bytes(b"whole"))

    def disk_full(tmp: Path) -> None:
        tmp.write_bytes(b"ha")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, disk_full)
    assert path.read_bytes() == b"whole"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]


def test_the_temporary_file_is_beside_the_target_so_the_rename_stays_on_one_file_system(tmp_path):
    seen: list[Path] = []
    atomic_write(tmp_path / "out.png", lambda tmp: seen.append(tmp) or tmp.write_bytes(b"png"))
    assert seen[0].parent == tmp_path and seen[0] != tmp_path / "out.png"
    assert not seen[0].exists()


def test_a_directory_where_the_file_should_go_is_an_error_naming_the_file_not_its_temporary_name(tmp_path):
    target = tmp_path / "metrics.png"
    target.mkdir()
    with pytest.raises(IsADirectoryError) as raised:
        atomic_write_text(target, "x")
    assert os_error_message(raised.value) == f"{target}: Is a directory"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.png"]  # no temporary file left beside it
