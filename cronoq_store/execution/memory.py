"""Python's cyclic garbage collector paused while objects are built to be kept."""

from __future__ import annotations

import gc

__all__ = ["collection_paused"]


class collection_paused:  # lower case: used as the function it was, `with collection_paused():`
    """Python's cyclic garbage collector off while objects are built to be kept (a
    recovery, an inbox read, a commit's rows until written), then back as it was.

    Recovering 100,000 tasks allocates about a million objects, all of them kept: every
    generation-0 pass on the way finds nothing to free, and those passes took 40% of
    recovery (a drain's read and commit of 1,000 items, a sixth). The objects hold no
    cycles, so nothing is left for the collector afterwards either; reference counting
    frees whatever is dropped meanwhile as usual. The collector is process-wide: a pause
    that finds it off leaves it to whoever turned it off.

    A class, not a generator: a leader's batch-1 commit enters two of these, and a
    generator-based context manager costs several times as much to enter and leave.
    """

    __slots__ = ("_paused",)

    def __enter__(self) -> None:
        self._paused = gc.isenabled()
        if self._paused:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._paused:
            gc.enable()
