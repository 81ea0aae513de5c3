"""Run the cronoq-store benchmark from the source tree: `python benchmarks/bench.py --help`.

The same command as `cronoq-store bench` and `python -m cronoq_store.bench`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cronoq_store.bench import bench

if __name__ == "__main__":
    bench()
