"""Python's cyclic garbage collector, paused while a schedule is read or written.

Reading or writing a large schedule builds millions of small objects (rows as mappings,
lists of cuts, their texts) that hold no reference cycles; the collector would scan them, and
everything already alive, again and again (doubling the time of a 10 MB file) and find
nothing to free, so it waits until the file is read or written."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (if it was running), and resume it after,
    also when the block raises."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
