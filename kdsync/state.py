"""The member's hard state on disk.

The core hands out `Ready.hard_state` (incarnation, view, members, promise,
accepted) whenever it changes; it must be on disk before any message of the
same Ready is sent, and it survives restarts.

`StateLog` keeps every ordering node's hard state of one member in one
append-only file, `state_dir/hardstate.log`: the hard states of every group
that changed in one loop iteration are appended and made durable with one
fsync (a group commit).  One file per node with its own fsyncs cost a member
with a hundred topics a hundred fsyncs on its loop whenever its groups
changed view together — at start-up, long enough to miss the view change's
timeouts round after round: the groups never formed.  Records are
length-prefixed and checksummed; a torn last record (a crash mid-write) is
cut off; the log is rewritten with the latest state of each node when it
has grown well past them.  `HardStateFile` is the older one-file-per-node
form: read once when the log has no state for a node (an upgrade).
"""

from __future__ import annotations

import fcntl
import os
import struct
import zlib
from pathlib import Path

import msgpack

from kdsync.core import HardState
from kdsync.fatal import FatalError

__all__ = ["HardStateFile", "StateDirLock", "StateLog"]


class HardStateFile:
    """The hard state of one ordering node at `path` (msgpack)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def save(self, hs: HardState) -> None:
        """Write `hs` atomically: temp file, fsync, rename, fsync of the
        directory.  Raises OSError when the disk refuses."""
        _write_atomically(self.path, _pack(hs))

    def load(self) -> HardState | None:
        """The saved hard state, None when there is none (a fresh member).
        Raises FatalError when the file is corrupt."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return _unpack(msgpack.unpackb(data, raw=False))
        except Exception:
            raise FatalError(f"state file {self.path} is corrupt; move it away to start this member afresh") from None



def _pack(hs: HardState) -> bytes:
    return msgpack.packb(_fields(hs), use_bin_type=True)


def _fields(hs: HardState) -> list:
    return [hs.incarnation, hs.view_id, list(hs.members), list(hs.promised), hs.accepted]


def _unpack(fields) -> HardState:
    inc, view_id, members, promised, accepted = fields
    return HardState(int(inc), int(view_id), tuple(members), (int(promised[0]), int(promised[1])), bytes(accepted))


def _fsync_dir(d: Path) -> None:
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_atomically(path: Path, data: bytes) -> None:
    """temp file, fsync, rename, fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


_HEAD = struct.Struct(">II")  # payload length, crc32 of the payload


def _record(topic: str, hs: HardState) -> bytes:
    payload = msgpack.packb([topic, *_fields(hs)], use_bin_type=True)
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


class StateDirLock:
    """One process per state directory: an exclusive `flock` on
    `state_dir/lock`, holding the holder's pid (Kafka locks `log.dirs` the
    same way).  The kernel drops the lock when the process ends, however it
    ends, so a kill -9 leaves nothing to clean up."""

    NAME = "lock"

    def __init__(self, directory: Path, name: str = NAME):
        self.path = Path(directory) / name  # name: "supervisor.lock" for `kdsync run --workers`
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; raises FatalError naming the holder's pid when
        another process has it (or when the directory cannot be made)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise FatalError(f"cannot use state directory {self.path.parent}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self.holder()
            os.close(fd)
            raise FatalError(f"state directory {self.path.parent} is in use by process {holder or '?'} (another "
                             f"member with the same state_dir? each member needs its own)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def holder(self) -> int | None:
        """The pid written by the process holding the lock, if any is readable."""
        try:
            return int(self.path.read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def held_by_other(self) -> int | None:
        """The holder's pid when another process holds the lock now, else None."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return self.holder() or -1
        finally:
            os.close(fd)
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class StateLog:
    """Every ordering node's hard state of one member, by topic, in one
    append-only file (module doc).  Not thread-safe: the member's loop."""

    NAME = "hardstate.log"

    def __init__(self, directory: Path, compact_bytes: int = 1 << 20):
        self.dir = Path(directory)
        self.path = self.dir / self.NAME
        self.compact_bytes = compact_bytes
        self.states: dict[str, HardState] = {}
        self._fd: int | None = None
        self._size = 0

    def load(self) -> dict[str, HardState]:
        """Read the log (and the older per-node files of nodes it has no
        state for); cut off a torn last record.  Raises FatalError when a
        record is corrupt."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        pos, n = 0, len(data)
        while pos < n:
            if pos + _HEAD.size > n:
                break  # a torn header
            length, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if end > n:
                break  # a torn record: the crash came mid-write, nothing after it was acknowledged
            payload = data[pos + _HEAD.size:end]
            if zlib.crc32(payload) != crc:
                raise FatalError(f"state file {self.path} is corrupt at byte {pos}; move it away to start this "
                                 f"member afresh")
            try:
                topic, *fields = msgpack.unpackb(payload, raw=False)
                self.states[topic] = _unpack(fields)
            except Exception:
                raise FatalError(f"state file {self.path} is corrupt at byte {pos}; move it away to start this "
                                 f"member afresh") from None
            pos = end
        if pos < n:
            with open(self.path, "r+b") as f:
                f.truncate(pos)
                os.fsync(f.fileno())
        self._size = pos
        for old in sorted(self.dir.glob("*.hardstate")) if self.dir.is_dir() else ():
            topic = old.name[: -len(".hardstate")]
            if topic not in self.states:
                hs = HardStateFile(old).load()
                if hs is not None:
                    self.states[topic] = hs
        return dict(self.states)

    def get(self, topic: str) -> HardState | None:
        return self.states.get(topic)

    def append(self, items: list[tuple[str, HardState]]) -> None:
        """Make the hard states of `items` (topic, state) durable, with one
        fsync.  Raises OSError when the disk refuses."""
        if self._fd is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            if new:
                _fsync_dir(self.dir)
        data = b"".join(_record(topic, hs) for topic, hs in items)
        os.write(self._fd, data)
        os.fsync(self._fd)
        self._size += len(data)
        for topic, hs in items:
            self.states[topic] = hs
        if self._size > max(self.compact_bytes, 4 * 256 * len(self.states)):
            self._compact()

    def _compact(self) -> None:
        """Rewrite the log with the latest state of each node (temp file,
        fsync, rename, fsync of the directory)."""
        data = b"".join(_record(topic, hs) for topic, hs in self.states.items())
        self.close()
        _write_atomically(self.path, data)
        self._size = len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
