"""pretrain/run/startup_gc.py: the collector is off inside the block, what the block made is frozen,
and the collector's state before the block comes back, also when the block raises."""

from __future__ import annotations

import gc

import pytest

from pretrain.run.startup_gc import imports_frozen


class Made:
    """An object the collector tracks, made inside the block."""


def test_the_collector_is_off_inside_and_back_on_after_with_what_the_block_made_frozen():
    assert gc.isenabled()
    with imports_frozen():
        assert not gc.isenabled()
        made = Made()
    assert gc.isenabled()
    assert gc.is_tracked(made) and not any(made is obj for obj in gc.get_objects())  # only the permanent generation holds it
    later = Made()
    assert any(later is obj for obj in gc.get_objects())  # what comes after is collected as before


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with imports_frozen():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_import_that_fails_still_turns_the_collector_back_on():
    with pytest.raises(ModuleNotFoundError), imports_frozen():
        import no_such_module_here  # noqa: F401
    assert gc.isenabled()
