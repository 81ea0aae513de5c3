"""A leader of whichever build is first on PYTHONPATH (the previous release, in
tests/migrations/test_rolling_deploy.py): it leads and commits until told to stop, then
releases and exits.

Written against the API both builds share. Usage: rolling_leader.py URL STOP_FILE. Lines out:
`ready VERSION REVISION`, then `acked N` after each commit (task N submitted, task N - 1
finished), `retry TYPE: MESSAGE` for a commit that failed and is tried again (as an engine
does: commits are idempotent), `error TYPE: MESSAGE` for one that cannot be (fenced, or failed
ten times), `bye` after releasing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import cronoq_store
from cronoq_store import Fenced, SqlStore, StatusChanged, Submitted, TaskId, TaskSpec, TaskStatus
from cronoq_store.migrate import current_revision
from cronoq_store.testing import BASE


def main(url: str, stop: Path) -> int:
    store = SqlStore.open(url)
    try:
        epoch = store.acquire_leadership(timeout=60)
        print("ready", cronoq_store.__version__, current_revision(store.engine), flush=True)
        n = epoch << 48
        while not stop.exists():
            n += 1
            batch: list[Submitted | StatusChanged] = [
                Submitted(id=TaskId(n), seq=n, arrival=n, spec=TaskSpec(payload=b"old"))
            ]
            if n > (epoch << 48) + 1:
                batch.append(
                    StatusChanged(id=TaskId(n - 1), status=TaskStatus.SUCCEEDED, attempt=1, at=n)
                )
            for attempt in range(10):
                try:
                    store.commit(epoch, BASE, batch)
                    break
                except Exception as exc:
                    said = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                    if isinstance(exc, Fenced) or attempt == 9:
                        print("error", said, flush=True)
                        return 3
                    print("retry", said, flush=True)
                    time.sleep(0.05)
            print("acked", n, flush=True)
            time.sleep(0.002)  # a busy leader, not a spinning one: the machine is shared
        return 0
    finally:
        store.close()
        print("bye", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
