"""Shutting a driver's socket down from another thread: how a session is interrupted on a
server database (`DefaultImpl.interrupter`). The descriptor stays the driver's to close."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

__all__ = ["shut", "shut_fd", "shut_transport"]


def shut(sock: socket.socket) -> None:
    """Shut `sock` down both ways (nothing if it is closed already)."""
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)


def shut_transport(transport: Any) -> None:
    """Shut down an asyncio transport's socket, read afresh (a closed one has none)."""
    raw = transport.get_extra_info("socket")
    if raw is not None:
        shut_fd(raw.fileno())


def shut_fd(fd: int) -> None:
    """Shut down the socket of file descriptor `fd`, which stays open (its owner closes it)."""
    if fd < 0:
        return
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        shut(sock)
    finally:
        sock.detach()  # the descriptor is the driver's, not ours to close
