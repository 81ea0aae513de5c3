"""The log that drivers and enqueuers share (`AckLog`, `read_log`): one `O_APPEND` write a
record, acknowledgements fsynced before they count.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class AckLog:
    """An append-only JSON-lines log shared by several processes.

    Each record is one `O_APPEND` write, so records of different processes never interleave;
    acknowledgements are fsynced before `append` returns.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        """The log file, created 0600 if new."""
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def append(self, record: Mapping[str, Any], *, sync: bool) -> None:
        """Append `record` as one line in one write; with `sync`, fsync before returning.

        Args:
            record: A JSON-ready record.
            sync: fsync the log before returning (an acknowledged record survives a crash).
        """
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            if sync:
                os.fsync(self._fd)

    def close(self) -> None:
        """Close the file; appending afterwards fails."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> AckLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_log(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """The records of a log, and how many lines could not be parsed (torn by a kill).

    Args:
        path: The log file.

    Returns:
        The parsed records, in order, and the count of lines that could not be parsed.
    """
    records: list[dict[str, Any]] = []
    torn = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if isinstance(obj, dict):
                records.append(obj)
            else:
                torn += 1
    return records, torn
