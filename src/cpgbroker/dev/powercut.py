"""A simulated power cut for the store directory of a killed process: :func:`cut` puts it in
a state a real power cut could have left, from the trace the process kept of what it made
durable (``[store] sync_trace``, store/tracedisk.py).

The process must be stopped (SIGKILL) first: the cut changes files under it. It applies the
contract of store/disk.py as :meth:`~cpgbroker.store.disk.SimDisk.crash` does:

* a rename done after its directory's last sync is undone (the file goes back to its old name);
* a name created after its directory's last sync is removed (with a directory's contents);
* every remaining file keeps its synced bytes and, with ``keep_unsynced="random"``, a random
  prefix of the bytes written after them (none, all, or a cut anywhere), sometimes with its
  last few kept bytes garbled (a page the disk wrote half of); with ``"none"``, nothing.

Afterwards the trace is rewritten to say that what is left is durable (it is what the disk
holds once the power is back), so the directory can be served, killed and cut again.

Limits: each cut picks an outcome a power cut could also have given (or a harsher one, after a
kill between an fsync and its trace line: see store/tracedisk.py), never a kinder one, but
some outcomes are out of reach:

* A file removed (or replaced by a rename) after its directory's last sync would come back
  whole in a real power cut; its bytes are gone, so here the removal stands. A directory
  change may reach the disk before it is synced, so this is one of the possible outcomes, and
  for the store a harmless one: it removes only what its durable metadata no longer needs
  (segments and a snapshot older than the base it names, files of a store it replaces). The
  other outcome (those files coming back) is covered by the store's tests on the simulated
  disk.
* A kill inside ``write_atomic`` after its rename and before its directory's sync keeps the
  new file: the outcome where the rename reached the disk.
* Files are cut to a prefix; a real disk may also keep a later page and lose an earlier one,
  or leave zeros where a page was never written.
* Files and directories the trace never saw (made before tracing, or by another program) are
  left as they are; so are a file's bytes from before tracing until its first traced sync.
* A store moved aside (``Store.discard``) takes its trace along; the new directory starts one
  of its own, and each is cut on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import random
import shutil
import signal
import time
from collections.abc import Iterable
from typing import Literal

import attrs

from cpgbroker.store.tracedisk import TRACE_NAME

# Probability that a file keeping part of its unsynced tail has its last bytes garbled.
GARBLE = 0.25


@attrs.define
class Cut:
    """What :func:`cut` did (paths relative to the store directory)."""

    removed: list[str] = attrs.field(factory=list)
    renames_undone: list[tuple[str, str]] = attrs.field(factory=list)
    # Renames after the directory's sync that could not be undone (see the module's limits).
    renames_kept: list[tuple[str, str]] = attrs.field(factory=list)
    # path -> (synced bytes, unsynced bytes found, unsynced bytes kept, bytes garbled)
    files: dict[str, tuple[int, int, int, int]] = attrs.field(factory=dict)

    @property
    def bytes_dropped(self) -> int:
        return sum(found - kept for _s, found, kept, _g in self.files.values())

    def summary(self) -> str:
        cuts = ", ".join(
            f"{rel} kept {kept} of {found}" + (f" ({garbled} garbled)" if garbled else "")
            for rel, (_synced, found, kept, garbled) in sorted(self.files.items())
        )
        return (
            f"removed {self.removed}, renames undone {self.renames_undone}, kept "
            f"{self.renames_kept}, {self.bytes_dropped} unsynced bytes dropped: {cuts or '-'}"
        )


@attrs.define
class _Trace:
    synced: dict[str, int] = attrs.field(factory=dict)
    # directory -> (line number of its last listing, the names it listed)
    dirs: dict[str, tuple[int, set[str]]] = attrs.field(factory=dict)
    # (line number, src, dst, replaced)
    renames: list[tuple[int, str, str, bool]] = attrs.field(factory=list)


def _parent(rel: str) -> str:
    return posixpath.dirname(rel) or "."


def _read_trace(path: str) -> _Trace:
    t = _Trace()
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            # Lines are written whole (one O_APPEND write); anything else is not a trace.
            raise ValueError(f"{path}: line {i + 1} is not a trace record: {line[:80]!r}") from None
        kind = rec[0]
        if kind == "N":
            t.synced[rec[1]] = 0
        elif kind == "S":
            t.synced[rec[1]] = int(rec[2])
        elif kind == "D":
            t.dirs[rec[1]] = (i, set(rec[2]))
        elif kind == "R":
            _, src, dst, replaced = rec
            if src in t.synced:
                t.synced[dst] = t.synced.pop(src)
            else:
                t.synced.pop(dst, None)
            t.renames.append((i, src, dst, bool(replaced)))
        elif kind == "X":
            t.synced.pop(rec[1], None)
        else:
            raise ValueError(f"{path}: line {i + 1}: unknown trace record {kind!r}")
    return t


def cut(
    store_dir: str | os.PathLike[str],
    rng: random.Random,
    keep_unsynced: Literal["random", "none"] = "random",
    garble: float = GARBLE,
) -> Cut:
    """Lose power under the store directory of a stopped process (see the module docstring);
    what was done. Raises ``FileNotFoundError`` if the directory has no trace."""
    if keep_unsynced not in ("random", "none"):
        raise ValueError(f"keep_unsynced must be 'random' or 'none', not {keep_unsynced!r}")
    root = os.fspath(store_dir)
    trace_path = os.path.join(root, TRACE_NAME)
    t = _read_trace(trace_path)
    done = Cut()

    def full(rel: str) -> str:
        return os.path.normpath(os.path.join(root, rel))

    # Newest first, so that a chain of renames unwinds to the first name.
    for line, src, dst, replaced in reversed(t.renames):
        d = _parent(dst)
        if _parent(src) != d or d not in t.dirs or line < t.dirs[d][0]:
            continue  # durable (its directory was synced after it), or not one to judge
        if replaced:
            # The file it replaced is gone: the rename stands (see the module's limits).
            done.renames_kept.append((src, dst))
        elif os.path.lexists(full(dst)) and not os.path.lexists(full(src)):
            os.rename(full(dst), full(src))
            if dst in t.synced:
                t.synced[src] = t.synced.pop(dst)
            done.renames_undone.append((src, dst))

    # Sorted: the same names go in the same order whatever order the trace has them in.
    for d in sorted(t.dirs):
        if not os.path.isdir(full(d)):
            continue
        durable = t.dirs[d][1]
        for name in sorted(os.listdir(full(d))):
            rel = posixpath.normpath(posixpath.join(d, name))
            if name in durable or rel == TRACE_NAME:
                continue
            p = full(rel)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.remove(p)
            t.synced.pop(rel, None)
            done.removed.append(rel)

    for rel in sorted(t.synced):
        p = full(rel)
        if not os.path.isfile(p):
            continue
        synced = t.synced[rel]
        size = os.path.getsize(p)
        pending = size - synced
        if pending <= 0:
            continue
        keep = 0
        if keep_unsynced == "random":
            # None, all and a cut anywhere are all likely, not just the middle.
            keep = rng.choice((0, pending, rng.randint(0, pending)))
        garbled = 0
        with open(p, "r+b") as f:
            f.truncate(synced + keep)
            if keep and rng.random() < garble:
                garbled = rng.randint(1, min(keep, 8))
                f.seek(synced + keep - garbled)
                old = f.read(garbled)
                f.seek(synced + keep - garbled)
                f.write(bytes(b ^ rng.randint(1, 255) for b in old))
        done.files[rel] = (synced, pending, keep, garbled)

    _rewrite_trace(root, trace_path, t)
    return done


def power_off(pids: Iterable[int], timeout: float = 10.0) -> None:
    """Kill processes and all their descendants (a member's snapshot child) at once, as a
    power cut would, and return once none of them runs: only then may :func:`cut` change
    their files. Each is stopped first (SIGSTOP) so that none forks or writes while its
    descendants are looked up; the caller still reaps its own children."""
    pids = list(pids)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    victims = set(pids)
    for pid in pids:
        victims |= _descendants(pid)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(_running(pid) for pid in victims):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {sorted(victims)} still run after SIGKILL")
        time.sleep(0.01)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold anything: the fields follow the last ")".
    fields = raw[raw.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _running(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _rewrite_trace(root: str, trace_path: str, t: _Trace) -> None:
    """What is left is durable: the disk holds it once the power is back."""
    lines: list[list[object]] = []
    for d in sorted(t.dirs):
        p = os.path.join(root, d)
        if os.path.isdir(p):
            lines.append(["D", d, sorted(os.listdir(p))])
    for rel in sorted(t.synced):
        p = os.path.join(root, rel)
        if os.path.isfile(p):
            lines.append(["S", rel, os.path.getsize(p)])
    tmp = trace_path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines))
    os.replace(tmp, trace_path)


__all__ = ["GARBLE", "Cut", "cut", "power_off"]
