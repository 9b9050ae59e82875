"""The `vllm` engine's side of P/D KV hand-over (hetmesh.engines.vllm_engine): its spool folder on tmpfs
and the KV files in it, and the kv_transfer_params that name them.

HetmeshConnector (hetmesh.engines.vllm_connector) runs inside vLLM and only reads and writes files; this
module is the worker-process half: where a PREFILL's shards are written, the hand-over's shard sizes, the
shards framed as one stream for the KV transfer (`take`), landed frames for a DECODE (`put`, or mapped and
filled straight from the socket by `sink`), and loaded files recycled so that tmpfs pages are reused.
Kept apart from the engine's request tracking, which only calls it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from .vllm_kv import shard_path

log = logging.getLogger(__name__)

SPOOL_PREFIX = "hetmesh-vllm-"
FREE_KV_FILES = 8
FREE_KV_BYTES = 1 << 30


def _spool_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _sweep_dead_spools() -> None:
    """Remove spool folders whose worker process is gone (killed before it could clean up)."""
    root = Path(_spool_root() or tempfile.gettempdir())
    for d in root.glob(f"{SPOOL_PREFIX}*-*"):
        pid = d.name[len(SPOOL_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def consumer_params(connector: str, handed: dict[str, Any] | None, landed: str | None) -> dict[str, Any] | None:
    """The decode request's kv_transfer_params: the prefill output's as they are (NIXL reads the blocks
    they name), ours pointed at the frame that landed here. None: compute the prompt here."""
    if not handed or not handed.get("do_remote_prefill"):
        return None
    # vLLM would report the prefill side's prefix hits as this request's cached tokens; the mesh reports
    # those itself (KvLanded.cached_tokens) and counts here what this engine did not compute.
    handed = {k: v for k, v in handed.items() if k != "remote_prefill_cached_tokens"}
    h = handed.get("hetmesh")
    if h is None:
        return handed if connector == "nixl" else None
    if landed is None or connector != "hetmesh":
        return None
    return {**handed, "hetmesh": {**h, "path": landed}}


class KvSpool:
    """One engine's spool folder (`spool_dir`, or a fresh one in /dev/shm it owns) and its KV files."""

    def __init__(self, spool_dir: str) -> None:
        self.own = not spool_dir
        if self.own:
            _sweep_dead_spools()
        self.path = Path(spool_dir or tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-", dir=_spool_root()))
        self.pending: dict[str, str] = {}  # DECODE request id -> landed KV file, until submitted
        self.prefill: dict[str, list[str]] = {}  # finished PREFILL request id -> its TP ranks' KV shards
        self.free: list[tuple[int, str]] = []  # (size, path): landed KV files already loaded, for reuse

    def kv_path(self, request_id: str) -> str:
        return str(self.path / f"{request_id}.{uuid.uuid4().hex[:8]}.kv")

    def remove(self) -> None:
        """Delete the folder if this engine made it."""
        if self.own:
            shutil.rmtree(self.path, ignore_errors=True)

    def handover(self, request_id: str, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """A finished PREFILL's kv_transfer_params for the decode side; ours gain the shards' sizes (the
        frame's layout), and `take` then finds the shard files."""
        if not params or not params.get("do_remote_prefill"):
            return None
        h = params.get("hetmesh")
        if h is None:
            return params
        shards = [shard_path(h["path"], r) for r in range(int(h["tp_size"]))]
        try:
            sizes = [os.stat(p).st_size for p in shards]
        except OSError:
            log.warning("request %s: a KV shard of %s is missing", request_id, h["path"])
            return None
        self.prefill[request_id] = shards
        return {**params, "hetmesh": {**h, "shard_bytes": sizes}}

    def take(self, request_id: str) -> bytes | memoryview | None:
        """The KV a finished PREFILL left (None with NIXL: the decode side reads it itself): every TP rank's
        shard file, back to back in rank order, the frame the hand-over's `shard_bytes` describe."""
        shards = self.prefill.pop(request_id, None)
        if shards is None:
            return None
        try:
            return frame(shards)
        except FileNotFoundError:
            return None
        finally:
            for p in shards:
                with contextlib.suppress(OSError):
                    os.unlink(p)

    def put(self, request_id: str, data: bytes | bytearray | memoryview) -> None:
        """KV bytes that landed for a DECODE: the consumer connector loads them when it is submitted."""
        path = self.kv_path(request_id)
        tmp = path + ".part"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self.pending[request_id] = path

    def sink(self, request_id: str, nbytes: int) -> _FileSink:
        """The landing file itself, mapped: the socket's bytes go straight into what the connector loads."""
        if nbytes <= 0:
            raise ValueError("an empty KV transfer")
        return _FileSink(self, request_id, self.kv_path(request_id), nbytes)

    def recycle(self, path: str) -> None:
        """Keep a loaded KV file's pages for the next transfer to land in (at most FREE_KV_FILES of them,
        FREE_KV_BYTES in all: the biggest are kept, they fit the most)."""
        try:
            size = os.stat(path).st_size
            free = str(self.path / f"free-{uuid.uuid4().hex[:12]}.kv")
            os.replace(path, free)
        except OSError:
            return
        self.free.append((size, free))
        self.free.sort(reverse=True)
        while len(self.free) > FREE_KV_FILES or sum(n for n, _ in self.free) > FREE_KV_BYTES:
            _, drop = self.free.pop()
            with contextlib.suppress(OSError):
                os.unlink(drop)

    def reuse(self, nbytes: int) -> str | None:
        """The free KV file that fits nbytes most tightly, or the biggest one when none is big enough."""
        if not self.free:
            return None
        fits = [i for i, (n, _) in enumerate(self.free) if n >= nbytes]
        return self.free.pop(fits[-1] if fits else 0)[1]


class _FileSink:
    """A KV file in the spool folder, mapped for the KV stream to fill (hetmesh.kvstream.KvSink)."""

    def __init__(self, spool: KvSpool, request_id: str, path: str, nbytes: int) -> None:
        self.spool, self.request_id, self.path = spool, request_id, path
        # A landed file already loaded by its request, renamed: its tmpfs pages are reused instead of
        # allocated and zeroed anew, which on a VM costs as much as the transfer itself.
        reused = spool.reuse(nbytes)
        if reused is not None:
            os.replace(reused, path + ".part")
        self._fd = os.open(path + ".part", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self._fd).st_size > nbytes:
                os.ftruncate(self._fd, nbytes)
            os.posix_fallocate(self._fd, 0, nbytes)  # tmpfs full fails here, not as SIGBUS mid-stream
            self._map = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            self.discard()
            raise ValueError(f"no room for {nbytes} bytes of KV in {spool.path}: {exc}") from exc
        self.view: memoryview | None = memoryview(self._map)

    def _close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        with contextlib.suppress(AttributeError, BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def commit(self) -> None:
        self._close()
        os.replace(self.path + ".part", self.path)
        self.spool.pending[self.request_id] = self.path

    def discard(self) -> None:
        self._close()
        with contextlib.suppress(OSError):
            os.unlink(self.path + ".part")


def frame(shards: list[str]) -> bytes | memoryview:
    """The shard files as one stream. One shard (TP 1) is mapped, its tmpfs pages sent as they are, never
    copied; several are read into one buffer (one copy, no join) so that the transfer stays one stream."""
    if len(shards) > 1:
        sizes = [os.stat(p).st_size for p in shards]
        buf = bytearray(sum(sizes))
        view, at = memoryview(buf), 0
        for p, n in zip(shards, sizes, strict=True):
            end = at + n
            with open(p, "rb", buffering=0) as f:
                while at < end:
                    got = f.readinto(view[at:end])
                    if not got:
                        raise FileNotFoundError(f"KV shard {p} shrank while read")
                    at += got
        return view
    with open(shards[0], "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return (memoryview(mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                     prot=mmap.PROT_READ)) if size else memoryview(b""))
