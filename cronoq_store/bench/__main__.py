"""`python -m cronoq_store.bench`: the same command as `cronoq-store bench`."""

from __future__ import annotations

from .command import bench

if __name__ == "__main__":
    bench()
