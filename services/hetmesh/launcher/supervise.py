"""Keeping a launched mesh up: every process that exits is started again, with backoff.

A service that exits (killed, crashed, or drained by SIGTERM and exited 0: an operator's drain is not the
end of the mesh) is started again; so are the nats-server and redis-server the launcher started, on the
same port (nats-server with its JetStream store). Meanwhile the rest of the mesh goes on as
docs/operations.md's "When a process dies" says: streams migrate, the bus reconnects, the prefix index is rebuilt.

Restarts back off exponentially (0.5 s doubling to 10 s; a run of 30 s resets it). A process that exits
more than `max_restarts` times within `window_s` crash-loops: it is given up and reported, and the rest
keeps running, except when it is the gateway, the scheduler or the nats-server, without which the mesh
serves nothing; then the launcher stops, with a non-zero exit.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .mesh import Mesh

ESSENTIAL = ("gateway", "scheduler", "nats-server")  # given up: nothing can be served


@dataclass
class Backoff:
    """When to start a process again after it exits, or None once it crash-loops."""

    first_s: float = 0.5
    cap_s: float = 10.0
    max_restarts: int = 5  # more exits than this within window_s: a crash loop
    window_s: float = 60.0
    stable_s: float = 30.0  # a run at least this long starts the backoff over
    exits: list[float] = field(default_factory=list)
    delay_s: float = 0.0

    def after_exit(self, now: float, ran_s: float) -> float | None:
        self.exits = [t for t in self.exits if now - t < self.window_s] + [now]
        if len(self.exits) > self.max_restarts:
            return None
        self.delay_s = self.first_s if ran_s >= self.stable_s or not self.delay_s else min(2 * self.delay_s, self.cap_s)
        return self.delay_s


@dataclass
class Unit:
    """One supervised process: a service of the mesh, or a server the launcher started."""

    name: str
    backoff: Backoff
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    due: float | None = None  # when to start it again (None: running, or given up)
    given_up: bool = False

    @property
    def state(self) -> str:
        return "given up" if self.given_up else "restarting" if self.due is not None else "running"


def how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return "exited 0 (drained or stopped)" if code == 0 else f"exited with {code}"


def report(line: str) -> None:
    print(f"hetmesh up: {line}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, mesh: Mesh, backoff: Callable[[], Backoff] = Backoff,
                 say: Callable[[str], None] = report) -> None:
        self.mesh = mesh
        self.say = say
        self.servers = {s.name: s for s in mesh.started_servers}
        self.units = {name: Unit(name, backoff()) for name in [*self.servers, *mesh.services]}
        self.failed = ""  # why the mesh cannot go on (an essential process given up)
        self.changed = True  # the run file is to be written again

    def step(self, now: float) -> None:
        """Reap what exited, and start what is due (servers first: the services need the bus)."""
        for name, srv in self.servers.items():
            code = srv.proc.poll() if srv.proc is not None else None  # poll() reaps: no zombie
            self._step(name, now, code, srv.start)  # same port, same folder (nats-server: its JetStream store)
        for name, svc in self.mesh.services.items():
            code = svc.proc.poll() if svc.proc is not None else None
            self._step(name, now, code, lambda n=name: self.mesh.spawn(n))

    def _step(self, name: str, now: float, code: int | None, start: Callable[[], object]) -> None:
        u = self.units[name]
        if u.given_up:
            return
        if u.due is None and code is not None:
            self._exited(u, now, f"{how_it_ended(code)} after {now - u.started:.1f} s", now - u.started)
        if u.due is not None and now >= u.due:
            try:
                start()
            except Exception as exc:  # e.g. a server whose port was taken meanwhile
                self._exited(u, time.monotonic(), f"failed to start again ({exc})", 0.0)
                return
            u.due, u.started, u.restarts, self.changed = None, time.monotonic(), u.restarts + 1, True
            self.say(f"{name} started again (restart {u.restarts})")

    def _exited(self, u: Unit, now: float, how: str, ran_s: float) -> None:
        self.changed = True
        delay = u.backoff.after_exit(now, ran_s)
        if delay is None:
            u.given_up, u.due = True, None
            window = u.backoff.window_s
            if u.name in ESSENTIAL:
                self.failed = f"{u.name} {how}, {len(u.backoff.exits)} exits within {window:g} s: the mesh cannot serve"
                self.say(f"{u.name} {how}; crash loop ({len(u.backoff.exits)} exits within {window:g} s): giving up")
            else:
                self.say(f"{u.name} {how}; crash loop ({len(u.backoff.exits)} exits within {window:g} s): "
                         "given up, the rest of the mesh keeps running")
            return
        u.due = now + delay
        self.say(f"{u.name} {how}; starting it again in {delay:g} s")

    @property
    def given_up(self) -> list[str]:
        return [u.name for u in self.units.values() if u.given_up]

    def services_state(self) -> dict[str, dict[str, object]]:
        """Per process: pid, restarts, state (the run file's `services`)."""
        procs = {**{n: s.proc for n, s in self.servers.items()}, **{n: s.proc for n, s in self.mesh.services.items()}}
        return {name: {"pid": procs[name].pid if procs[name] is not None else None, "restarts": u.restarts,
                       "state": u.state} for name, u in self.units.items()}

    def run(self, stopping: Callable[[], bool], on_change: Callable[[], None] = lambda: None,
            period_s: float = 0.2) -> None:
        """Until `stopping()` says so or an essential process is given up (then `failed` says why)."""
        while not stopping() and not self.failed:
            self.step(time.monotonic())
            if self.changed:
                self.changed = False
                on_change()
            time.sleep(period_s)
