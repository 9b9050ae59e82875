"""The batching core alone (no engine shell, no simulator): its memory bookkeeping holds at every step."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.batching import Core, Kind, Seq, Settings, State


def _blocks_of(core: Core, s: Seq) -> tuple[int, int]:
    """(private blocks, capacity) of a running seq, with a decode's lazily counted growth worked out."""
    if s.state == State.DECODING and s.active:
        bs = core.s.block_size
        k = (core._crossed - s.f) // bs + 1
        return s.private + k, s.capacity + k * bs
    return s.private, s.capacity


def _check(core: Core) -> None:
    cache = core.cache
    assert cache.free >= 0
    assert sum(_blocks_of(core, s)[0] for s in core.running.values()) == cache.private
    pins = Counter(h for s in core.running.values() for h in s.hashes[: s.npinned])
    assert {h: n for h, n in cache.refs.items() if n} == dict(pins)
    assert set(core.running) == set(core.prefilling) | set(core.decoding)
    assert core.n_waiting == sum(1 for s in core.seqs.values() if s.state == State.WAITING)


_seq = st.tuples(st.sampled_from([Kind.FULL, Kind.FULL, Kind.PREFILL, Kind.DECODE]), st.integers(1, 120),
                 st.integers(1, 40), st.integers(0, 3), st.integers(0, 2), st.sampled_from([0, 0, 0, -1, 1, 2]))


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(_seq, min_size=1, max_size=16), kv_blocks=st.integers(24, 80),
       order=st.sampled_from(["fcfs", "shortest"]), aborts=st.sets(st.integers(0, 15), max_size=3),
       arrive_every=st.integers(0, 5))
def test_memory_is_conserved_and_every_sequence_ends(seqs: list[tuple[Kind, int, int, int, int, int]], kv_blocks: int,
                                                     order: str, aborts: set[int], arrive_every: int) -> None:
    core = Core(Settings(max_batch=6, kv_blocks=kv_blocks, block_size=8, step_tokens=64, prefill_order=order))
    prefixes = [[1000 + j for j in range(4)], [2000 + j for j in range(4)], [3000 + j for j in range(4)]]
    todo = []
    for i, (kind, prompt, out, shared, first, priority) in enumerate(seqs):
        hashes = (prefixes[shared % 3][: shared] if shared else []) + [10_000 * (i + 1) + j for j in range(20)]
        n_first = 1 + first if kind == Kind.DECODE else 0
        todo.append(Seq(i, kind, prompt, hashes, max(out, n_first) if kind != Kind.PREFILL else 1, n_first, priority))
    done: dict[int, Seq] = {}
    steps = 0
    while (todo or core.seqs) and steps < 5000:
        if todo and (not arrive_every or steps % arrive_every == 0):
            s = todo.pop(0)
            core.add(s)
            if s.rid in aborts and s.rid % 2:
                core.abort(s.rid)  # while it waits
        step = core.schedule()
        _check(core)
        for s in core.decoding.values():  # every decode's next token has its block
            assert s.prompt_len + core.generated(s) <= _blocks_of(core, s)[1]
        for s in step.ended:
            done[s.rid] = s
        if step.empty:
            steps += 1
            continue
        out = core.update(step)
        _check(core)
        for s in out.finished:
            done[s.rid] = s
        for rid in [r for r in aborts if r in core.running and r % 2 == 0]:
            core.abort(rid)  # while it runs
            aborts.discard(rid)
        steps += 1
    assert not core.seqs and not todo, "every sequence ends"
    assert core.cache.private == 0 and core.cache.used == 0
    for s in done.values():
        assert s.generated == (1 if s.kind == Kind.PREFILL else s.max_new)


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 100), st.integers(1, 80), st.integers(0, 3)), min_size=1, max_size=12),
       kv_blocks=st.integers(30, 120), gaps=st.lists(st.integers(0, 40), min_size=12, max_size=12))
def test_a_run_of_quiet_steps_is_the_steps_one_by_one(seqs: list[tuple[int, int, int]], kv_blocks: int,
                                                      gaps: list[int]) -> None:
    """`quiet` + `skip` (the simulator's shortcut over plain decode steps) end every sequence at the same
    step, with the same memory and counters, as schedule + update step by step."""
    arrivals = [sum(gaps[: i + 1]) for i in range(len(seqs))]  # the step before which each one is added

    def run(shortcut: bool) -> tuple[dict[int, int], tuple[int, ...]]:
        core = Core(Settings(max_batch=6, kv_blocks=kv_blocks, block_size=8, step_tokens=64))
        ended: dict[int, int] = {}
        pending = list(enumerate(seqs))
        while pending or core.seqs:
            while pending and arrivals[pending[0][0]] <= core.tick:
                i, (prompt, out, shared) = pending.pop(0)
                core.add(Seq(i, Kind.FULL, prompt, [77 + j for j in range(shared)] + [1000 * (i + 1)], out))
            step = core.schedule()
            if step.empty:
                core.tick += 1  # idle until the next arrival
                continue
            k = core.quiet(step, 1000) if shortcut else 0
            if pending:  # an arrival cuts the run before its step
                k = max(min(k, arrivals[pending[0][0]] - 1 - step.tick), 0)
            for s in core.skip(step, k).finished:
                ended[s.rid] = core.tick - 1
            _check(core)
        st_ = core.stats
        return ended, (st_.steps, st_.tokens_generated, st_.prompt_tokens_computed, st_.preempted, core.tick)

    assert run(True) == run(False)


def _run(core: Core) -> tuple[list[str], list[str]]:
    """Step the core to the end: the order sequences were first admitted in, and those preempted."""
    admitted, preempted = [], []
    while core.seqs:
        step = core.schedule()
        admitted += [s.rid for s in step.admitted]
        preempted += [s.rid for s in core.seqs.values() if s.state == State.WAITING and s.admitted]
        core.update(step)
    return admitted, sorted(set(preempted))


def test_priority_orders_the_queue_as_vllms_priority_scheduling() -> None:
    """vLLM's request priority: lower first, arrival order among equals; 0 is the default."""
    core = Core(Settings(max_batch=1, kv_blocks=64, block_size=8, step_tokens=64))
    for rid, priority in (("a", 0), ("b", 1), ("c", -1), ("d", 0), ("e", -1)):
        core.add(Seq(rid, Kind.FULL, 10, [], 3, priority=priority))
    assert _run(core)[0] == ["c", "e", "a", "d", "b"]


def test_preemption_takes_the_highest_priority_value_then_the_newest() -> None:
    """Two decodes outgrow 6 blocks: the newer is preempted, unless the older one has the higher priority value."""
    for x_priority, victim in ((0, "y"), (1, "x")):
        core = Core(Settings(max_batch=4, kv_blocks=6, block_size=8, step_tokens=64))
        core.add(Seq("x", Kind.FULL, 8, [], 30, priority=x_priority))
        core.update(step := core.schedule())  # x runs before y arrives
        assert [s.rid for s in step.admitted] == ["x"]
        core.add(Seq("y", Kind.FULL, 8, [], 30))
        admitted, preempted = _run(core)
        assert admitted == ["y"] and preempted == [victim]
