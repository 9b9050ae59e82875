"""Who is alive, from their beats: the instances heard on a beat subject, and when each was last heard.

The schedulers beat on `hetmesh.sched.alive.<instance>` (heard by the gateways, which send submits to a live
one, and by the other schedulers, whose bookings and KV-index writer they decide); the gateways beat on
`hetmesh.gateway.alive.<instance>` (heard by the workers, which cancel what a dead gateway asked for). One
instance counts as alive while heard within `timeout_s`. A listener's own bus outage hides every beat, so
after one (`bus_gap`) each instance's clock starts again; so does a stall of the listener's own process (a
GC pause, CPU starvation: `overslept`, `paused`), whose unread beats wait in its socket meanwhile. Pure: `now`
is passed in; no I/O.
"""

from __future__ import annotations


class Beats:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # silent this long: gone
        self._last: dict[str, float] = {}

    def __len__(self) -> int:
        """The instances held: heard, and neither forgotten nor dropped by `forget_silent` since."""
        return len(self._last)

    def heard(self, instance: str, now: float) -> None:
        self._last[instance] = now

    def bus_gap(self, now: float) -> None:
        """The listener's bus was away: the beats it missed say nothing about the instances."""
        for k, t in self._last.items():
            self._last[k] = max(t, now)

    def paused(self, seconds: float, now: float) -> None:
        """The listener's own process did not run for `seconds` up to `now` (`overslept`): that time is not
        silence (a beat heard since counts as it is)."""
        for k, t in self._last.items():
            self._last[k] = min(t + seconds, now)

    def alive(self, instance: str, now: float) -> bool:
        t = self._last.get(instance)
        return t is not None and now - t <= self.timeout_s

    def live(self, now: float) -> list[str]:
        """The instances heard within the timeout, in the order first heard."""
        return [k for k, t in self._last.items() if now - t <= self.timeout_s]

    def silent(self, now: float) -> set[str]:
        """The instances heard once and silent for the timeout since."""
        return {k for k, t in self._last.items() if now - t > self.timeout_s}

    def forget(self, instance: str) -> None:
        self._last.pop(instance, None)

    def forget_silent(self, now: float, age_s: float) -> list[str]:
        """Forget the instances silent for `age_s`; returns them."""
        old = [k for k, t in self._last.items() if now - t > age_s]
        for k in old:
            del self._last[k]
        return old


def overslept(last: float, period_s: float, now: float) -> float:
    """How long a loop that wakes every `period_s` (last at `last`) was kept from running past its period: 0 when
    it woke within two periods. Beats heard by the same process waited unread for as long."""
    late = now - last - period_s
    return late if late > period_s else 0.0
