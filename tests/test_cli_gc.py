"""``acp-server serve`` collects garbage less often than CPython's default (see ``cli.tune_gc``)."""

from __future__ import annotations

import gc

from acp_server.cli import GC_THRESHOLD, tune_gc


def test_tune_gc_raises_the_young_threshold_and_freezes_startup_objects() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLD
        assert GC_THRESHOLD[0] > before[0]
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
