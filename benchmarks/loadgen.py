"""Load generation for the benchmarks: a minimal HTTP/1.1 SSE client and open/closed loops.

A raw-socket client on a keep-alive pool, because on a 2-core machine the client's own CPU
competes with the mesh it measures; httpx or the openai client would cost several times more
per request than the gateway does.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


@dataclass(slots=True)
class Result:
    ttft_s: float
    total_s: float
    ok: bool
    completion_tokens: int = 0
    second_s: float = 0.0  # to the second token (SSEClient.second_token): in P/D, the decode worker's first
    body: bytes = b""  # the whole HTTP response (SSEClient.keep_body)


_EVENT = re.compile(rb"data: (\{.*?\})\n\n")


@dataclass
class SSEClient:
    host: str
    port: int
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # Also stamp the second token: parses every event (the gateway may merge tokens that reach it together,
    # so it counts text characters, one per token with a byte tokenizer), which costs client CPU.
    second_token: bool = False
    keep_body: bool = False  # return the whole response in Result.body (to check the streamed text)

    async def stream(self, path: str, body: bytes) -> Result:
        """POST one streaming request and read it to the end."""
        request = (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                   % (path.encode(), len(body), body))
        reused = bool(self.idle)
        r, w = self.idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
        t0 = time.perf_counter()
        w.write(request)
        buf = b""
        ttft = second = 0.0
        while True:
            try:
                data = await r.read(65536)
            except ConnectionResetError:
                if buf or not reused:
                    raise
                data = b""  # a reused keep-alive connection the server had closed: reset, not EOF
            if not data:
                if buf:
                    self.failures.append(f"connection closed mid-response: {buf[-200:]!r}")
                    return Result(ttft, time.perf_counter() - t0, False, second_s=second)
                # The server closed an idle keep-alive connection just as we reused it: a fresh one.
                reused = False
                r, w = await asyncio.open_connection(self.host, self.port)
                w.write(request)
                continue
            buf += data
            if not ttft and b"data: {" in buf:
                ttft = time.perf_counter() - t0
            if self.second_token and ttft and not second and sum(
                    len(json.loads(e)["choices"][0]["text"]) for e in _EVENT.findall(buf)) >= 2:
                second = time.perf_counter() - t0
            if buf.endswith(b"\r\n0\r\n\r\n") or (not buf.startswith(b"HTTP/1.1 200") and b"}" in buf):
                break
        total = time.perf_counter() - t0
        ok = buf.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in buf
        if ok:
            self.idle.append((r, w))
        else:
            self.failures.append(buf[-300:].decode(errors="replace"))
            w.close()
        m = _USAGE.search(buf, max(len(buf) - 600, 0))
        return Result(ttft, total, ok, int(m.group(1)) if m else 0, second, buf if self.keep_body else b"")

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                r, w = await asyncio.open_connection(self.host, self.port)
                w.write(b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
                ready = (await r.read(100)).startswith(b"HTTP/1.1 200")
                w.close()
                if ready:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError("gateway not ready")


async def open_loop(client: SSEClient, path: str, rate: float, seconds: float,
                    body: Callable[[int], bytes], poisson: bool = True, seed: int = 1) -> list[Result]:
    """Requests at fixed arrival times (Poisson or evenly spaced) regardless of how fast they finish."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Result]] = []
    start = time.perf_counter()
    t_next, i = 0.0, 0
    while t_next < seconds:
        delay = start + t_next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.stream(path, body(i))))
        i += 1
        t_next += rng.expovariate(rate) if poisson else 1.0 / rate
    return list(await asyncio.gather(*tasks))


async def closed_loop(client: SSEClient, path: str, concurrency: int, seconds: float,
                      body: Callable[[int, int], bytes]) -> list[Result]:
    """`concurrency` clients, each sending its next request when the previous one ends."""
    deadline = time.perf_counter() + seconds
    out: list[Result] = []

    async def user(k: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            out.append(await client.stream(path, body(k, n)))
            n += 1

    await asyncio.gather(*(user(k) for k in range(concurrency)))
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def cpu_ticks() -> list[int]:
    """The machine's CPU time split (/proc/stat: user nice system idle iowait irq softirq steal ...)."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def steal_fraction(t0: list[int], t1: list[int]) -> float:
    """Share of the machine's CPU time the hypervisor gave to others meanwhile: on a shared VM it
    varies from run to run and drags the tail with it."""
    d = [b - a for a, b in zip(t0, t1, strict=True)]
    return d[7] / max(sum(d[:8]), 1) if len(d) > 7 else 0.0


def percentile(xs: Iterable[float], q: float) -> float:
    """q in [0, 1]; nan when empty."""
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)] if s else float("nan")


TCP_PIECE = 1 << 20


def tcp_sink(port: int, keep: bool) -> None:
    """The baseline's receiving process: read length-prefixed payloads, ack each; `keep`: into a fresh
    buffer of the payload's size (kept until the next one), else into one reused 1 MiB buffer."""
    srv = socket.create_server(("127.0.0.1", port))
    conn, _ = srv.accept()
    buf = bytearray(TCP_PIECE)
    view = memoryview(buf)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        left = struct.unpack("!Q", head)[0]
        if keep:
            buf = bytearray(left)
            view = memoryview(buf)
        off = 0
        while left:
            got = conn.recv_into(view[off:] if keep else view, left if keep else min(left, TCP_PIECE))
            if not got:
                return
            left -= got
            off += got if keep else 0
        conn.sendall(b"k")


def raw_tcp_mb_per_s(sizes: list[int], repeats: int, keep: bool) -> dict[int, float]:
    """The KV benchmarks' baseline: MB/s per payload size over one loopback TCP connection from this process
    to a sink process (sendall of 1 MiB pieces, the sink acknowledges each payload's last byte)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = subprocess.Popen([sys.executable, "-m", "hetmesh.loadgen", "--tcp-sink", str(port)]
                            + (["--keep"] if keep else []))
    try:
        for _ in range(100):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.05)
        out: dict[int, float] = {}
        for n in sizes:
            data = memoryview(os.urandom(n))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                conn.sendall(struct.pack("!Q", n))
                for off in range(0, n, TCP_PIECE):
                    conn.sendall(data[off:off + TCP_PIECE])
                assert conn.recv(1) == b"k"
                times.append(time.perf_counter() - t0)
            out[n] = n / 1e6 / statistics.median(times)
        conn.close()
        return out
    finally:
        sink.wait(10)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="the raw TCP baseline's sink process")
    ap.add_argument("--tcp-sink", type=int, required=True)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    tcp_sink(a.tcp_sink, a.keep)
