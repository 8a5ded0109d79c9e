"""The pieces behind issue #34's dead-rank and SIGTERM items, alone and fast:

- :class:`~tinypipe.distributed.links.PeerLinks` (two ranks as two threads of this process, a
  dictionary as the store): a peer whose sockets close without a word is reported ``died``; one
  that says it stops, ``stopped``; one that says it leaves, ``left`` -- each once.
- the watchdog's verdicts: a death at once, a stopping peer after its grace (or at once when this
  rank's own collective already failed), a leaving one never.
- :class:`~tinypipe.runtime.exit_guard.ExitGuard` (in a child process: it ends it): an exit while a
  checkpoint is being written removes the partial directory; an exit during the swap waits for it
  and leaves the new checkpoint whole.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from tinypipe.distributed.links import LEAVING, STOPPING, PeerLinks
from tinypipe.distributed.watchdog import Watchdog


class DictStore:
    """What the links and the watchdog use of a TCPStore (``get`` waits for the key)."""

    host, port = "127.0.0.1", 1

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self.cond:
            self.data[key] = value.encode()
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.data, timeout=10), key
            return self.data[key]

    def add(self, key: str, n: int) -> int:
        with self.cond:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def _pair(store: DictStore) -> tuple[PeerLinks, PeerLinks]:
    made: dict[int, PeerLinks] = {}
    threads = [threading.Thread(target=lambda r=r: made.__setitem__(r, PeerLinks.connect(store, r, 2)))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert set(made[0].peers) == {1} and set(made[1].peers) == {0}
    return made[0], made[1]


def _news(links: PeerLinks) -> list:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        news = links.wait(0.5)
        if news:
            return news
    return []


def test_links_tell_a_death_from_a_stop_and_a_leave() -> None:
    store = DictStore()
    for word, expected in ((None, "died"), (STOPPING, "stopped"), (LEAVING, "left")):
        zero, one = _pair(store)  # a fresh mesh each round (its own keys)
        t0 = time.monotonic()
        if word is not None:
            one.say(word)
        for sock in one.peers.values():  # the process ends: the kernel closes its sockets
            sock.close()
        assert _news(zero) == [(1, expected)]
        assert time.monotonic() - t0 < 1.0
        assert zero.wait(0.2) == []  # reported once
        zero.close()


def test_watchdog_verdicts() -> None:
    dog = Watchdog(DictStore(), 0, 3, grace_s=0.3)
    assert dog._judge([(2, "left")]) is None and 2 in dog._left
    assert dog._judge([(1, "stopped")]) is None  # its grace: this rank may end on its own
    time.sleep(0.35)
    assert (dog._judge([]) or "").startswith("tinypipe: rank 1 stopped (")
    line = dog._judge([(1, "stopped"), (2, "died")])
    assert line is not None and line.startswith("tinypipe: rank 2 died (") and line.endswith("rank 0 stops")


GUARDED = r"""
import sys, threading, time
from pathlib import Path
from tinypipe.runtime.exit_guard import ExitGuard

root, case = Path(sys.argv[1]), sys.argv[2]
final, tmp = root / "checkpoint", root / "checkpoint.tmp"
guard = ExitGuard()
guard.describe = lambda: "; note"
later = threading.Timer(0.3, guard.exit_now, args=("tinypipe: stopping", 143))
with guard.writing(tmp, create=True):
    (tmp / "layer-0000.safetensors").write_bytes(b"x" * 1000)
    later.start()
    if case == "writing":
        time.sleep(30)  # the exit lands here, mid-write
    with guard.committing(tmp):
        time.sleep(1.0)  # the exit waits for the swap
        final.rename(root / "checkpoint.old")
        tmp.rename(final)
        (root / "checkpoint.old" / "state.json").unlink()
        (root / "checkpoint.old").rmdir()
    time.sleep(30)
"""


def test_exit_guard_removes_a_partial_write_and_waits_for_a_swap(tmp_path: Path) -> None:
    procs = {}
    for case in ("writing", "committing"):
        root = tmp_path / case
        (root / "checkpoint").mkdir(parents=True)
        (root / "checkpoint" / "state.json").write_text("previous")
        procs[case] = subprocess.Popen([sys.executable, "-c", GUARDED, str(root), case], text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for case, proc in procs.items():
        _, err = proc.communicate(timeout=60)
        root = tmp_path / case
        assert proc.returncode == 143, err
        assert err.strip() == "tinypipe: stopping; note", err
        assert not (root / "checkpoint.tmp").exists() and not (root / "checkpoint.old").exists()
        kept = sorted(p.name for p in (root / "checkpoint").iterdir())
        assert kept == (["state.json"] if case == "writing" else ["layer-0000.safetensors"]), kept
