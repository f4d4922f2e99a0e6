"""The member's hard state on disk: one file per ordering node.

The core hands out `Ready.hard_state` (incarnation, view, members, promise,
accepted) whenever it changes; it must be on disk before any message of the
same Ready is sent, and it survives restarts.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgpack

from kdsync.core import HardState
from kdsync.fatal import FatalError

__all__ = ["HardStateFile"]


class HardStateFile:
    """The hard state of one ordering node at `path` (msgpack)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def save(self, hs: HardState) -> None:
        """Write `hs` atomically: temp file, fsync, rename, fsync of the
        directory.  Raises OSError when the disk refuses."""
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        data = msgpack.packb([hs.incarnation, hs.view_id, list(hs.members), list(hs.promised), hs.accepted],
                             use_bin_type=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def load(self) -> HardState | None:
        """The saved hard state, None when there is none (a fresh member).
        Raises FatalError when the file is corrupt."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            inc, view_id, members, promised, accepted = msgpack.unpackb(data, raw=False)
            return HardState(int(inc), int(view_id), tuple(members), (int(promised[0]), int(promised[1])),
                             bytes(accepted))
        except Exception:
            raise FatalError(f"state file {self.path} is corrupt; move it away to start this member afresh") from None
