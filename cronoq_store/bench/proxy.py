"""A TCP proxy that adds network latency and counts round trips, for `cronoq-store bench --rtt`.

One host has no network latency to speak of, and this kernel has no `netem`; a store's cost at
0.5-20 ms between client and server shows only behind something that delays its packets. The
proxy forwards bytes both ways, each chunk held for `delay` seconds (one way: 10 ms each way is
a 20 ms round trip) and sent in the order it arrived, so the protocol sees a slow wire, not a
reordering one.

It also counts the round trips the client asks for, by protocol (`Proxy.count`):

- PostgreSQL: the client's Sync and simple Query messages. Each is answered by one
  ReadyForQuery, which the client waits for (what `tests/test_round_trips.py` counts): a
  pipelined flight of statements costs one, however many statements it carries.
- MySQL / MariaDB: the client's command packets (a packet with sequence number 0 starts a new
  command, answered before the next; a multi-statement packet is one command). The server's
  `Questions` counter says the same from the other side.
- Anything else: nothing is counted (`count` stays 0); bytes are still forwarded and delayed.

The connection handshake (startup, authentication) is not counted: a pool opens a connection
once. Time is what includes it.

Run it on its own for clients of other languages (`benchmarks/bench_peers.py` does so in
process): ``python -m cronoq_store.bench.proxy --target 127.0.0.1:5432 --delay-ms 10``.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar, Final

from sqlalchemy import URL

from .. import dialects

Protocol = str
"""Which client messages the proxy counts as round trips: a database's `wire`
(`dialects.DefaultImpl.wire`), or "none"."""

_CHUNK: Final = 65536
_PG_UNTYPED: Final = (80877103, 80877104)  # SSLRequest, GSSENCRequest: then the startup


class _Counter:
    """Reads the client's byte stream of one connection and counts its round trips: nothing,
    for a protocol no subclass reads. One subclass per wire protocol, registered by the `wire`
    of its database's class (`dialects.DefaultImpl.wire`)."""

    wire: ClassVar[str | None] = None
    _registry: ClassVar[dict[str | None, type[_Counter]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        _Counter._registry[cls.wire] = cls

    @staticmethod
    def of(protocol: Protocol) -> type[_Counter]:
        """The counter of `protocol` (the base, which counts nothing, for one unknown)."""
        return _Counter._registry.get(protocol, _Counter)

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.buffer = b""
        self.skip = 0  # bytes of a message already counted, not yet seen

    def feed(self, data: bytes) -> None:
        if self.skip:
            taken = min(self.skip, len(data))
            self.skip -= taken
            data = data[taken:]
        self.buffer += data
        self._count()

    def _count(self) -> None:
        """Count the whole messages in the buffer and drop them."""
        self.buffer = b""

    def _consume(self, length: int) -> bool:
        """Drop a message of `length` bytes from the buffer (what is not here yet, later)."""
        if len(self.buffer) >= length:
            self.buffer = self.buffer[length:]
            return True
        self.skip = length - len(self.buffer)
        self.buffer = b""
        return False


class _PostgresqlCounter(_Counter):
    """The client's Sync and simple Query messages (not Terminate, which no answer follows)."""

    wire: ClassVar[str | None] = dialects.PostgresqlImpl.wire

    def __init__(self, proxy: Proxy) -> None:
        super().__init__(proxy)
        self.startup = True  # the first messages carry no type byte

    def _count(self) -> None:
        while True:
            if self.startup:
                if len(self.buffer) < 8:
                    return
                length, code = struct.unpack("!ii", self.buffer[:8])
                self.startup = code in _PG_UNTYPED
            else:
                if len(self.buffer) < 5:
                    return
                kind = self.buffer[:1]
                length = struct.unpack("!i", self.buffer[1:5])[0] + 1
                if kind in (b"S", b"Q"):
                    self.proxy._counted()
            if not self._consume(length):
                return


_COM_QUIT: Final = 0x01
"""MySQL's command that closes a connection: the server sends nothing back."""


class _MySQLCounter(_Counter):
    """The client's command packets but COM_QUIT, which no answer follows."""

    wire: ClassVar[str | None] = dialects.MySQLImpl.wire

    def _count(self) -> None:
        while len(self.buffer) >= 4:
            length = int.from_bytes(self.buffer[:3], "little") + 4
            if self.buffer[3] == 0:  # sequence 0: a new command (the handshake reply is 1)
                if len(self.buffer) < 5:
                    return  # its command byte comes with the next chunk
                if self.buffer[4] != _COM_QUIT:
                    self.proxy._counted()
            if not self._consume(length):
                return


class Proxy:
    """A latency proxy on 127.0.0.1 in front of `target` (host, port); `port` is where to
    connect. `delay` is the one-way delay in seconds, applied to each chunk in each direction.
    Use as a context manager, or `close` it."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        delay: float = 0.0,
        protocol: Protocol = "none",
        listen: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        self.target = target
        self.delay = delay
        self.protocol: Protocol = protocol
        self.listener = socket.create_server(listen)
        self.port: int = self.listener.getsockname()[1]
        self.count = 0
        """Round trips the clients asked for so far (see the module's doc)."""
        self.connections = 0
        """Connections accepted so far."""
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="latency-proxy", daemon=True).start()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _counted(self) -> None:
        with self._lock:
            self.count += 1

    def close(self) -> None:
        """Stop accepting and cut every connection through the proxy."""
        self._closed = True
        self.listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self.connections += 1
                self._sockets += [client, server]
            counter = _Counter.of(self.protocol)(self)
            self._pump(client, server, counter)
            self._pump(server, client, None)

    def _pump(self, src: socket.socket, dst: socket.socket, counter: _Counter | None) -> None:
        """Forward `src` to `dst`: a reader that stamps each chunk, a writer that sends it
        `delay` after it arrived, in order (one queue, one writer: nothing overtakes)."""
        chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(_CHUNK):
                    if counter is not None:
                        counter.feed(data)
                    chunks.put((time.monotonic() + self.delay, data))
            chunks.put((0.0, b""))

        def write() -> None:
            with contextlib.suppress(OSError):
                while True:
                    due, data = chunks.get()
                    if not data:
                        break
                    if (wait := due - time.monotonic()) > 0:
                        time.sleep(wait)
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        threading.Thread(target=read, name="latency-proxy-read", daemon=True).start()
        threading.Thread(target=write, name="latency-proxy-write", daemon=True).start()


def protocol_of(backend: str) -> Protocol:
    """The protocol a SQLAlchemy backend name speaks: its database class's `wire`."""
    return dialects.class_of(backend).wire or "none"


@contextlib.contextmanager
def proxied_url(url: URL, *, delay: float) -> Iterator[tuple[URL, Proxy]]:
    """`url` rerouted through a new `Proxy` adding `delay` seconds each way (TLS off on
    PostgreSQL, so the proxy can read the messages); the proxy is closed after."""
    impl = dialects.class_of(url)
    target = (url.host or "127.0.0.1", url.port or impl.default_port or 0)
    proxy = Proxy(target, delay=delay, protocol=impl.wire or "none")
    routed = url.set(host="127.0.0.1", port=proxy.port)
    if impl.plaintext_query:
        routed = routed.update_query_dict(dict(impl.plaintext_query))
    try:
        yield routed, proxy
    finally:
        proxy.close()


def main(argv: list[str] | None = None) -> None:
    """Run a proxy in the foreground until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else "")
    parser.add_argument("--target", required=True, help="HOST:PORT of the server")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay, ms")
    parser.add_argument(
        "--protocol", choices=[*sorted(w for w in _Counter._registry if w), "none"], default="none"
    )
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    lhost, _, lport = args.listen.rpartition(":")
    proxy = Proxy(
        (host, int(port)),
        delay=args.delay_ms / 1000,
        protocol=args.protocol,
        listen=(lhost, int(lport)),
    )
    sys.stdout.write(f"listening on {lhost}:{proxy.port}\n")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.close()


if __name__ == "__main__":
    main()
