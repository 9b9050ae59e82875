"""The launcher's run file: where a mesh started by `hetmesh up` can be found, and how its services are.

`hetmesh up` writes `mesh-<pid>.json` in the run folder while it runs (NATS, Redis and gateway URLs, its
pid, and per service the pid, restarts and state) and removes it when it stops. `hetmesh status` reads the
newest one whose launcher is still alive, so it finds a mesh on a random NATS port without flags; a file
left by a launcher that was killed is ignored and removed.

The run folder: $HETMESH_RUN_DIR, else $XDG_RUNTIME_DIR/hetmesh, else <tmp>/hetmesh-<uid>.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def run_dir() -> Path:
    if d := os.environ.get("HETMESH_RUN_DIR"):
        return Path(d)
    if d := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(d) / "hetmesh"
    return Path(tempfile.gettempdir()) / f"hetmesh-{os.getuid()}"


def path_for(pid: int) -> Path:
    return run_dir() / f"mesh-{pid}.json"


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat), None if it is gone or a zombie:
    with the pid it names one process, not whichever gets the pid next."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if not Path("/proc").is_dir():  # no procfs: fall back to "the pid exists"
            try:
                os.kill(pid, 0)
                return ""
            except ProcessLookupError:
                return None
            except PermissionError:
                return ""
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return None if fields[0] in ("Z", "X") else fields[19]


def alive(pid: int, start: str | None = None) -> bool:
    """`pid` runs (not a zombie), and is the process that started at `start` when that is given."""
    now = _start_time(pid)
    return now is not None and (start is None or not start or not now or now == start)


def write(state: dict[str, Any]) -> Path:
    """Write this process's run file (atomically: readers never see half of it)."""
    pid = os.getpid()
    state = {**state, "pid": pid, "pid_start": _start_time(pid) or ""}
    path = path_for(pid)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)
    return path


def remove() -> None:
    with contextlib.suppress(FileNotFoundError):
        path_for(os.getpid()).unlink()


def live_meshes() -> list[dict[str, Any]]:
    """Every mesh whose launcher still runs, newest first; stale files are removed on the way."""
    found = []
    for f in run_dir().glob("mesh-*.json"):
        try:
            state = json.loads(f.read_text())
            pid = int(state["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if alive(pid, str(state.get("pid_start", ""))):
            found.append(state)
        else:
            with contextlib.suppress(OSError):
                f.unlink()
    return sorted(found, key=lambda s: float(s.get("started_at", 0)), reverse=True)


def find(nats_url: str | None = None) -> dict[str, Any] | None:
    """The newest live mesh (or the one on `nats_url`), None if there is none."""
    for state in live_meshes():
        if nats_url is None or state.get("nats_url") == nats_url:
            return state
    return None
