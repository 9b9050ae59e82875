"""Real vLLM through the whole mesh: gateway, scheduler, kv-transfer and four vLLM workers, each its
own process (two aggregated workers for `tiny-agg`, a prefill and a decode worker for `tiny-pd`, the
same tiny model behind both names), driven with the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from hetmesh import subjects
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.kvindex.index import PrefixIndex
from hetmesh.launcher import Mesh
from hetmesh.protocol import Heartbeat, ResponseEvent, Role, RoleSwitch, SchedulerStatus, TokenChunk
from hetmesh.tokenizer import HFTokenizer

from ..clusters import cluster_toml, group
from ..e2e.conftest import EventLog, running_mesh
from ..e2e.conftest import events as events  # the same fixture, on this module's mesh
from .conftest import BLOCK, MAX_TOKENS, TEXTS, tiny_model_entry


def cluster(model_dir: Path) -> str:
    return cluster_toml(
        mesh={"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, "stall_timeout_s": 60.0},
        scheduler={"policy": "prefix_aware"},
        models=[tiny_model_entry("tiny-agg", model_dir), tiny_model_entry("tiny-pd", model_dir)],
        # the accelerator is a label for the cost model only: vLLM runs on this machine's CPU
        workers=[group("cpu", "tiny-agg", "nvidia-h100", engine="vllm", count=2, max_batch=8),
                 group("cpu-p", "tiny-pd", "nvidia-h100", role="prefill", engine="vllm", max_batch=8),
                 group("cpu-d", "tiny-pd", "nvidia-h100", role="decode", engine="vllm", max_batch=8)])


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(
        tmp_path_factory.mktemp("vllm-mesh"),
        cluster(tiny_model),
        ready_timeout_s=400,  # four vLLM engines starting at once on two cores
        env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    ) as m:
        yield m


@pytest.fixture(scope="module")
def aclient(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=120)


def spool_files(pid: int, prefix: str) -> list[str]:
    """The files in worker `pid`'s vLLM spool folder (hetmesh.engines.vllm_engine) whose names start with
    `prefix`; fails when the folder is not there."""
    from hetmesh.engines.vllm_spool import SPOOL_PREFIX, _spool_root

    root = Path(_spool_root() or tempfile.gettempdir())
    spools = list(root.glob(f"{SPOOL_PREFIX}{pid}-*"))
    assert spools, f"no spool folder of process {pid} in {root}"
    return [f.name for d in spools for f in d.iterdir() if f.name.startswith(prefix)]


def _rid(completion_id: str) -> str:
    return completion_id.split("-", 1)[1] if "-" in completion_id else completion_id


async def _complete(aclient: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int = MAX_TOKENS,
                    stream: bool = False) -> tuple[str, str, openai.types.CompletionUsage | None, str | None]:
    body = {"ignore_eos": True}
    if not stream:
        r = await aclient.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             extra_body=body)
        return r.id, r.choices[0].text, r.usage, r.choices[0].finish_reason
    s = await aclient.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True}, extra_body=body)
    rid, text, usage, finish = "", [], None, None
    async for c in s:
        rid = c.id
        if c.choices:
            text.append(c.choices[0].text)
            finish = c.choices[0].finish_reason or finish
        if c.usage is not None:
            usage = c.usage
    return rid, "".join(text), usage, finish


async def test_greedy_text_is_vllms_aggregated_and_disaggregated(
        aclient: openai.AsyncOpenAI, events: EventLog, reference: list[dict], tiny_model: Path) -> None:
    tok = HFTokenizer(str(tiny_model / "tokenizer.json"))
    for i, text in enumerate(TEXTS):
        want = reference[i]["text"]  # vLLM alone, detokenized by vLLM
        _, agg, usage, finish = await _complete(aclient, "tiny-agg", text)
        rid, pd, pd_usage, pd_finish = await _complete(aclient, "tiny-pd", text, stream=True)
        assert agg == want and pd == want
        assert finish == pd_finish == "length"
        assert usage is not None and pd_usage is not None
        assert usage.completion_tokens == pd_usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == pd_usage.prompt_tokens == len(tok.encode(text))
        placed = await events.wait_for(_rid(rid), "placed")
        assert placed.detail["mode"] == "disaggregated"
        landed = await events.wait_for(_rid(rid), "kv_landed")
        # The decode worker got the prefill worker's real KV: whole 128-token blocks of every layer.
        assert int(landed.detail["bytes_received"]) == int(landed.detail["nbytes"]) > 0  # type: ignore[arg-type]


async def test_decode_worker_computes_none_of_the_prompt(aclient: openai.AsyncOpenAI, mesh: Mesh) -> None:
    seen: dict[str, Heartbeat] = {}
    nc = await nats.connect(mesh.nats_url)

    async def on_hb(m: object) -> None:
        hb = msgspec.json.decode(m.data, type=Heartbeat)  # type: ignore[attr-defined]
        seen[hb.worker_id] = hb

    await nc.subscribe(subjects.heartbeat("cpu-d-0"), cb=on_hb)
    await nc.subscribe(subjects.heartbeat("cpu-p-0"), cb=on_hb)
    try:
        for _ in range(200):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.05)
        before_d, before_p = seen["cpu-d-0"], seen["cpu-p-0"]
        prompt = TEXTS[2] + " seven eight nine"
        n = len(HFTokenizer(mesh.cfg.model("tiny-pd").tokenizer).encode(prompt))
        await _complete(aclient, "tiny-pd", prompt, max_tokens=8)
        await asyncio.sleep(1.0)  # a few heartbeats later
        d, p = seen["cpu-d-0"], seen["cpu-p-0"]
    finally:
        await nc.close()
    # The decode engine computed one position (the prefill side's first token) and loaded the prompt.
    assert d.prompt_tokens_computed - before_d.prompt_tokens_computed == 1
    assert d.prompt_tokens_cached - before_d.prompt_tokens_cached == n
    assert p.prompt_tokens_computed - before_p.prompt_tokens_computed + \
        (p.prompt_tokens_cached - before_p.prompt_tokens_cached) == n
    assert d.tokens_generated - before_d.tokens_generated == 7


async def test_kv_events_reach_redis_and_prefix_aware_routing_hits(
        aclient: openai.AsyncOpenAI, events: EventLog, mesh: Mesh) -> None:
    shared = TEXTS[0] + " system prompt shared by every turn " * 8
    rid, _, _, _ = await _complete(aclient, "tiny-agg", shared + " first question", max_tokens=2)
    holder = (await events.wait_for(_rid(rid), "placed")).detail["decode_worker"]
    other = "cpu-1" if holder == "cpu-0" else "cpu-0"
    tok = HFTokenizer(mesh.cfg.model("tiny-agg").tokenizer)
    hashes = block_hashes("tiny-agg", tok.encode(shared + " first question"), BLOCK)
    index = PrefixIndex.from_url(mesh.redis_url)
    try:
        held: dict[str, int] = {}
        for _ in range(100):  # vLLM's events -> worker -> scheduler -> Redis
            held = await index.lookup("tiny-agg", hashes)
            if held.get(holder) == len(hashes):
                break
            await asyncio.sleep(0.1)
        assert held.get(holder) == len(hashes), held
        assert other not in held
    finally:
        await index.close()
    # Load the holder so that least-loaded alone would send the repeat to the other worker.
    busy = asyncio.create_task(aclient.completions.create(model="tiny-agg", prompt="busy " * 50, max_tokens=300,
                                                          extra_body={"ignore_eos": True}))
    try:
        await asyncio.sleep(1.0)
        rid2, _, usage, _ = await _complete(aclient, "tiny-agg", shared + " second question", max_tokens=2)
        placed = await events.wait_for(_rid(rid2), "placed", policy="prefix_aware")  # the scheduler's record
        assert placed.detail["decode_worker"] == holder
        assert int(placed.detail["cached_tokens"] or 0) >= BLOCK, [  # type: ignore[arg-type]
            (e.kind, e.detail) for e in events.events if e.service == "scheduler" and not e.request_id]
        # vLLM's own prefix cache served those blocks.
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens >= BLOCK
    finally:
        busy.cancel()
        with contextlib.suppress(BaseException):
            await busy


async def test_client_disconnect_aborts_vllm_and_frees_its_blocks(mesh: Mesh, events: EventLog) -> None:
    import httpx

    beats: list[Heartbeat] = []
    nc = await nats.connect(mesh.nats_url)

    async def on_hb(m: object) -> None:
        beats.append(msgspec.json.decode(m.data, type=Heartbeat))  # type: ignore[attr-defined]

    await nc.subscribe(subjects.heartbeat("cpu-d-0"), cb=on_hb)
    body = {"model": "tiny-pd", "prompt": TEXTS[1], "max_tokens": 800, "stream": True, "ignore_eos": True,
            "temperature": 0}
    rid = None
    try:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        rid = rid or line.split('"id":"', 1)[1].split('"', 1)[0]
                        n += 1
                        # Hang up a few tokens in: on a quiet machine the tiny model can finish all 800
                        # within a few heartbeats (0.2 s apart), so do not wait for one to show the blocks.
                        if n >= 5:
                            break
        assert rid is not None
        try:
            aborted = await events.wait_for(_rid(rid), "aborted", timeout_s=15)
        except TimeoutError:
            if not any(b.aborted for b in beats) and beats and beats[-1].running == 0:
                pytest.skip("the engine generated all 800 tokens before the hang-up reached it: nothing to abort "
                            "(the sim-engine cancellation tests in tests/failures cover every phase)")
            raise
        assert aborted.detail["worker_id"] == "cpu-d-0"
        assert 0 < int(aborted.detail["completion_tokens"]) < 800  # type: ignore[arg-type]
        n_beats = len(beats)
        for _ in range(100):  # the engine freed them: its next reports say so
            if len(beats) > n_beats + 1 and beats[-1].kv_blocks_used == 0 and beats[-1].running == 0:
                break
            await asyncio.sleep(0.1)
        assert beats[-1].kv_blocks_used == 0 and beats[-1].running == 0, beats[-1]
        assert beats[-1].aborted >= 1
        # ... and neither worker keeps a spool file of it (a KV file still named for the request; the engine
        # keeps loaded files' pages under free-* names for the next transfer)
        for name in ("worker:cpu-d-0", "worker:cpu-p-0"):
            left = spool_files(mesh.services[name].proc.pid, f"{_rid(rid)}.")  # type: ignore[union-attr]
            assert left == [], (name, left)
    finally:
        await nc.close()


async def _roles(nc: nats.NATS, want: dict[str, Role]) -> None:
    """Send each worker its RoleSwitch and wait until the scheduler's view has them in those roles, settled."""
    for wid, role in want.items():
        await nc.publish(subjects.worker_command(wid), msgspec.json.encode(RoleSwitch(worker_id=wid, role=role,
                                                                                       planner="test")))
    async with asyncio.timeout(60):
        while True:
            st = msgspec.json.decode((await nc.request(subjects.SCHED_STATUS, b"", timeout=5)).data,
                                     type=SchedulerStatus)
            got = {w.worker_id: w for w in st.details}
            if all(w in got and got[w].role == r and not got[w].moving_to for w, r in want.items()):
                return
            await asyncio.sleep(0.1)


async def test_prefill_and_decode_workers_swap_roles_without_a_restart(mesh: Mesh, events: EventLog,
                                                                     aclient: openai.AsyncOpenAI) -> None:
    """A role switch on vLLM (the planner's RoleSwitch): cpu-p-0 and cpu-d-0 swap prefill and decode with
    their engines running (every engine's KV connector is kv_role "kv_both": tests/vllm/test_role_switch.py).
    A tiny-pd completion then prefills on cpu-d-0 and decodes on cpu-p-0, in the same processes, with the
    same greedy text as before the swap; then they swap back."""
    workers = ("cpu-p-0", "cpu-d-0")
    pids = {w: mesh.services[f"worker:{w}"].proc.pid for w in workers}  # type: ignore[union-attr]
    prompt = TEXTS[2]
    _, before, _, _ = await _complete(aclient, "tiny-pd", prompt)
    nc = await nats.connect(mesh.nats_url)
    try:
        await _roles(nc, {"cpu-p-0": Role.DECODE, "cpu-d-0": Role.PREFILL})
        rid, after, usage, _ = await _complete(aclient, "tiny-pd", prompt, stream=True)
        assert after == before and usage is not None and usage.completion_tokens == MAX_TOKENS
        prefill = await events.wait_for(_rid(rid), "prefill_done", timeout_s=15)
        decode = await events.wait_for(_rid(rid), "decode_done", timeout_s=15)
        assert (prefill.detail["worker_id"], decode.detail["worker_id"]) == ("cpu-d-0", "cpu-p-0")
        assert {w: mesh.services[f"worker:{w}"].proc.pid for w in workers} == pids  # type: ignore[union-attr]
    finally:
        await _roles(nc, {"cpu-p-0": Role.PREFILL, "cpu-d-0": Role.DECODE})
        await nc.close()


async def _bus_reaches(chunks: Callable[[], list[TokenChunk]], n: int, timeout_s: float = 15.0) -> None:
    """Wait until the chunks seen on the bus include one that ends at token n (index + tokens >= n)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not any(c.index + len(c.token_ids) >= n for c in chunks()):
        assert asyncio.get_running_loop().time() < deadline, f"the bus never showed token {n}"
        await asyncio.sleep(0.05)


async def test_greedy_stream_survives_its_worker_sigkilled(mesh: Mesh, events: EventLog,
                                                          aclient: openai.AsyncOpenAI) -> None:
    """Migration with a real engine: the aggregated worker streaming a greedy completion is SIGKILLed
    mid-stream, and the stream goes on on the other worker from the tokens so far. The token ids on the
    bus (`hetmesh.resp.>`, as `nats sub` shows them) say what happened. The first attempt's tokens are
    the undisturbed run's, and the new worker's are exactly what vLLM generates for the prompt plus those
    tokens. No token is lost or repeated, and the client's text is the two joined: exactly the
    undisturbed run's text, because here (fp32, the CPU) vLLM's one prefill over prompt + k tokens gives
    the same logits, bit for bit, as the k decode steps did (benchmarks/vllm_migration_numerics.py:
    0 of 378 continuations differ, in fp32 and in bf16, largest logprob difference 0 in fp32). Where the two paths
    round differently (other kernels, other hardware) greedy can flip at a near-tie and go on
    differently, still token for token what vLLM generates for prompt + k (checked; the text then checked up to
    the move). Greedy only: vLLM cannot
    start a seeded sampler at a position of its random stream. Last in this file: it leaves one of the
    two aggregated workers dead."""
    import json

    import httpx

    tok = HFTokenizer(mesh.cfg.model("tiny-agg").tokenizer)
    prompt, n = TEXTS[0], 600  # long enough that the kill lands mid-stream (a token takes milliseconds)
    prompt_ids = tok.encode(prompt)
    on_bus: dict[str, list[TokenChunk]] = {}  # reply subject -> its chunks
    nc = await nats.connect(mesh.nats_url)

    armed, killed = False, []  # the first chunk of the stream below on the bus kills its worker at once

    async def on_chunk(m: object) -> None:
        ev = msgspec.json.decode(m.data, type=ResponseEvent)  # type: ignore[attr-defined]
        if isinstance(ev, TokenChunk):
            on_bus.setdefault(m.subject, []).append(ev)  # type: ignore[attr-defined]
            if armed and not killed and ev.index == 0:
                killed.append(ev.worker_id)
                mesh.kill(f"worker:{ev.worker_id}")

    def on_bus_of(r: str) -> list[TokenChunk]:
        return [c for subj, cs in on_bus.items() if f".{r}-" in subj for c in cs]

    await nc.subscribe("hetmesh.resp.>", cb=on_chunk)
    try:
        want_id, want, _, _ = await _complete(aclient, "tiny-agg", prompt, max_tokens=n)
        body = {"model": "tiny-agg", "prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        chunks: list[dict] = []
        await _bus_reaches(lambda: on_bus_of(_rid(want_id)), n)  # its chunks queued for on_chunk must not arm the kill
        armed = True
        async with httpx.AsyncClient(base_url=mesh.url, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
        victim = killed[0]
        rid = _rid(chunks[0]["id"])
        assert not [c for c in chunks if "error" in c]
        assert chunks[-1]["usage"]["completion_tokens"] == n
        assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt_ids)
        # The gateway and this test subscribe apart: the HTTP stream can end before on_chunk has seen every
        # chunk (CI saw 455 of 599), so wait until the bus holds this stream's last token.
        await _bus_reaches(lambda: on_bus_of(rid), n)
        # The bus says what happened: the victim's chunks, then another worker's from index k.
        mine = on_bus_of(rid)
        second = [c for c in mine if c.worker_id != victim]
        if not second:
            pytest.skip(f"the engine streamed all {n} tokens before the SIGKILL landed: nothing to migrate "
                        "(the sim-engine migration tests in tests/failures cover it)")
        k = min(c.index for c in second)
        assert 1 <= k < n

        def in_order(cs: list[TokenChunk]) -> list[int]:
            # by position: a resume (the gateway saw a hole) has the worker publish chunks again, as on a bus
            at = {c.index + i: t for c in cs for i, t in enumerate(c.token_ids)}
            return [at[i] for i in sorted(at)]

        def ids_of(attempt: int) -> list[int]:  # 0: the victim's tokens, 1: the new worker's
            return in_order([c for c in mine if (c.worker_id == victim) == (attempt == 0)])

        before, after = ids_of(0)[:k], ids_of(1)
        assert len(before) == k and len(after) == n - k
        undisturbed = in_order([c for subj, cs in on_bus.items() if subj.endswith(f".{_rid(want_id)}-0") for c in cs])
        assert before == undisturbed[:k]  # before the move: the undisturbed run's tokens
        # What vLLM itself continues the prompt plus those k tokens with (greedy, the same worker's engine).
        cont = await aclient.completions.create(model="tiny-agg", prompt=[*prompt_ids, *before], max_tokens=n - k,
                                                temperature=0, extra_body={"ignore_eos": True})
        await _bus_reaches(lambda: on_bus_of(_rid(cont.id)), n - k)
        ref = next(cs for subj, cs in on_bus.items() if subj.endswith(f".{_rid(cont.id)}-0"))
        assert after == in_order(ref)
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert text.endswith(cont.choices[0].text)
        head = text[:len(text) - len(cont.choices[0].text)]
        assert want.startswith(head)  # before the move: the undisturbed run's text
        flip = next((i for i, (a, b) in enumerate(zip(after, undisturbed[k:], strict=True)) if a != b), None)
        if flip is None:  # the same tokens after the move too: then the same text, the join included (a prompt
            assert text == want  # + k tokens may end mid-character: hetmesh.engines.vllm_detok)
    finally:
        await nc.close()
