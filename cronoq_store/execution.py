"""How the store's work runs, as opposed to what it runs: mechanics with no SQL of their own."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collection_paused"]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a bulk decode, then back as it was.

    Recovering 100,000 tasks allocates about a million objects, all of them kept: every
    generation-0 pass on the way finds nothing to free, and those passes took 40% of
    recovery. The objects hold no cycles, so nothing is left for the collector afterwards
    either; reference counting frees whatever is dropped meanwhile as usual.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
