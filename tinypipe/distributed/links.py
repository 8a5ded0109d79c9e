"""Dead peers seen at once: one TCP connection between every two ranks, held open for the run.

When a process ends -- killed (SIGKILL, the OOM killer), crashed -- its kernel closes its sockets,
so each peer reads end-of-file within milliseconds: nothing to wait out, and no false alarm from a
peer that is only slow (a busy or GIL-bound rank keeps its connection open; a heartbeat with a
timeout short enough for "within seconds" would misjudge it). Before ending on purpose a rank
writes one byte saying how: :data:`LEAVING` (its run is over) or :data:`STOPPING` (an error or a
signal ends it; its own line says which), so only a silent end-of-file means it died. A hung peer
(SIGSTOP, a wedged driver) keeps its connection: the heartbeat of
:mod:`~tinypipe.distributed.watchdog` names it after its timeout.

The mesh costs ``world_size - 1`` sockets per rank. Each rank listens on the address it reaches the
rendezvous store from and publishes it in the store (``tinypipe/link/<n>/<rank>``); a rank connects to
every higher rank and accepts the lower ones. Where no address can be found (a store without a
host) or a peer cannot be reached, that pair is left to the heartbeat.
"""

from __future__ import annotations

import json
import selectors
import socket
import struct
import time
from typing import Literal

LEAVING, STOPPING = b"L", b"S"
Event = Literal["died", "left", "stopped"]
_WORDS: dict[int, Event] = {LEAVING[0]: "left", STOPPING[0]: "stopped"}
_HELLO = struct.Struct("!I")  # the connecting rank's number


def _key(generation: int, rank: int) -> str:
    return f"tinypipe/link/{generation}/{rank}"


def store_host(store: object) -> tuple[str, int] | None:
    """The (host, port) of the TCPStore under ``store`` (PrefixStores unwrapped); None for other stores."""
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    return (str(host), int(port or 1)) if host else None


def local_address(store: object) -> str | None:
    """This host's address on the route to the store's host (a UDP connect sends nothing)."""
    where = store_host(store)
    if where is None:
        return None
    try:
        family, _, _, _, address = socket.getaddrinfo(*where, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return None


class PeerLinks:
    """This rank's open connections to its peers; :meth:`wait` reports how peers ended."""

    def __init__(self, peers: dict[int, socket.socket]) -> None:
        self.peers = peers
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        for rank, sock in peers.items():
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, rank)

    @classmethod
    def connect(cls, store: object, rank: int, world_size: int, timeout_s: float = 30.0) -> PeerLinks:
        """Build the mesh (every rank calls this at the same point of start-up; the store's ``get``
        waits for a peer's address)."""
        # the n-th mesh of this process group (an engine per mesh): a later one never reads an
        # earlier one's addresses (every rank builds its meshes in the same order)
        generation = int(store.add(f"tinypipe/link-meshes/{rank}", 1))  # type: ignore[attr-defined]
        address = local_address(store)
        listener = None
        if address is not None:
            try:
                listener = socket.create_server((address, 0), family=_family(address), backlog=world_size)
            except OSError:
                listener = None
        published = [address, listener.getsockname()[1]] if listener is not None else None
        store.set(_key(generation, rank), json.dumps(published))  # type: ignore[attr-defined]
        peers: dict[int, socket.socket] = {}
        for peer in range(rank + 1, world_size):  # connect up: accepted by the peer below
            where = json.loads(store.get(_key(generation, peer)))  # type: ignore[attr-defined]
            if where is None:
                continue
            try:
                sock = socket.create_connection((where[0], int(where[1])), timeout=timeout_s)
                sock.sendall(_HELLO.pack(rank))
                peers[peer] = sock
            except OSError:
                continue
        if listener is not None:  # the ranks below that listen connect to this one
            lower = sum(json.loads(store.get(_key(generation, p))) is not None  # type: ignore[attr-defined]
                        for p in range(rank))
            peers.update(_accept_lower(listener, rank, lower, timeout_s))
        return cls(peers)

    def wait(self, timeout_s: float) -> list[tuple[int, Event]]:
        """Up to ``timeout_s`` for news: each peer that ended since, and how (a peer is reported once)."""
        news: list[tuple[int, Event]] = []
        for key, _ in self._selector.select(max(0.0, timeout_s)):
            if key.data is None:  # :meth:`wake`
                self._wake_r.recv(64)
                continue
            rank, sock = int(key.data), key.fileobj
            try:
                data = sock.recv(64)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:  # reset: the peer's kernel dropped the connection
                data = b""
            said = [_WORDS[b] for b in data if b in _WORDS]
            news.append((rank, said[0] if said else "died"))
            self._selector.unregister(sock)  # what follows a word (the end-of-file) is not news
        return news

    def say(self, word: bytes) -> None:
        """Tell every peer how this rank ends (best effort: a peer already gone is skipped)."""
        for sock in self.peers.values():
            try:
                sock.send(word)
            except OSError:
                pass

    def wake(self) -> None:
        """Make a :meth:`wait` in another thread return now."""
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass

    def close(self) -> None:
        self._selector.close()
        for sock in (*self.peers.values(), self._wake_r, self._wake_w):
            sock.close()


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _accept_lower(listener: socket.socket, rank: int, expected: int,
                  timeout_s: float) -> dict[int, socket.socket]:
    """The connections of ``expected`` ranks below ``rank`` (each says who it is), until all came or
    time ran out."""
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    with listener:
        while len(peers) < expected and time.monotonic() < deadline:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock, _ = listener.accept()
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                hello = _recv_exactly(sock, _HELLO.size)
            except OSError:
                continue
            peer = _HELLO.unpack(hello)[0] if hello is not None else rank
            if peer < rank:
                peers[peer] = sock
            else:
                sock.close()
    return peers


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data
