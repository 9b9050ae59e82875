"""One response from several mesh requests: `n > 1` and a list of prompts, one `Call` per choice.

Each choice is an ordinary request of the mesh (its own placement, retries, resumes); here they are
submitted together and their replies merged: a non-streamed body with every choice in index order,
or one SSE stream whose chunks carry their choice's index as they come, then one usage chunk.
Any choice failing fails the response and cancels the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from hetmesh.protocol import ErrorInfo, TokenChunk, Usage

from . import core
from .core import Formatter
from .responses import JSON, ClientGone, SseBody, error_response

if TYPE_CHECKING:
    from .call import Call

T = TypeVar("T")


async def _all(coros: list[Awaitable[T]]) -> list[T]:
    """gather, but the others are cancelled (and awaited) when one raises."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class FanOut:
    def __init__(self, calls: list[Call], fmts: list[Formatter], stream: bool) -> None:
        self.calls = calls
        self.fmts = fmts
        self.stream = stream

    def usage(self) -> Usage:
        """Each prompt counted once (n choices of one prompt share it), every choice's completion."""
        us = [(c.usage(), c.prep.counts_prompt) for c in self.calls]
        return Usage(prompt_tokens=sum(u.prompt_tokens for u, once in us if once),
                     completion_tokens=sum(u.completion_tokens for u, _ in us),
                     cached_tokens=sum(u.cached_tokens for u, once in us if once))

    def cancel(self, reason: str) -> None:
        for c in self.calls:
            c.cancel(reason)

    def fail(self, info: ErrorInfo) -> Response:
        self.cancel("sibling_failed")
        for c in self.calls:
            c.record_error(info)
        return error_response(info)

    def close(self) -> None:
        for c in self.calls:
            c.close()

    async def run(self) -> Response:
        calls = self.calls
        for c in calls:
            c.gw.event(c.rid, "received", model=c.req.model, prompt_tokens=len(c.req.prompt_tokens),
                       max_tokens=c.req.sampling.max_tokens, stream=self.stream, choice=c.prep.index)
        handed_off = False
        try:
            errs = await _all([c.submit() for c in calls])
            err = next((e for e in errs if e is not None), None)
            if err is not None:
                return self.fail(err)
            if not self.stream:
                got = await _all([c.collect() for c in calls])
                bad = next((g for g in got if isinstance(g, ErrorInfo)), None)
                if bad is not None:
                    return self.fail(bad)
                choices = [f.choice(g, c.stream.finish_reason)  # type: ignore[arg-type]
                           for f, g, c in zip(self.fmts, got, calls, strict=True)]
                return Response(self.fmts[0].body(choices, self.usage()), media_type=JSON)
            firsts = await _all([c.pull() for c in calls])  # before the 200: an early failure gets its status
            bad = next((g for g in firsts if isinstance(g, ErrorInfo)), None)
            if bad is not None:
                return self.fail(bad)
            handed_off = True
            return FanOutSse(self, firsts)  # type: ignore[arg-type]
        except ClientGone:
            self.cancel("client_disconnected")
            for c in calls:
                c.status = 499
            return Response(status_code=499)
        except BaseException:
            self.cancel("gateway_error")
            raise
        finally:
            if not handed_off:
                self.close()


class FanOutSse(SseBody):
    """The merged SSE body: each choice's chunks as they come, tagged with its index."""

    def __init__(self, fan: FanOut, first: list[list[TokenChunk]]) -> None:
        super().__init__()
        self.fan = fan
        self.first = first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fan = self.fan
        calls, fmts = fan.calls, fan.fmts
        finished = False
        tasks: dict[asyncio.Task[list[TokenChunk] | ErrorInfo], int] = {}
        try:
            await self.start(send)
            body = b""
            for i, (c, f, chunks) in enumerate(zip(calls, fmts, self.first, strict=True)):
                c.start_stream_span()
                body += f.sse_chunks(chunks, first=True)
                c.stream.sent()
                c.record_first_token()
                if c.stream.done:
                    c.record_finished()
                else:
                    tasks[asyncio.ensure_future(c.pull())] = i
            while True:
                if not tasks:
                    body += self._tail()
                    finished = True
                await send({"type": "http.response.body", "body": body, "more_body": not finished})
                if finished:
                    return
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                body = b""
                for t in done:
                    i = tasks.pop(t)
                    got = t.result()  # ClientGone propagates
                    if isinstance(got, ErrorInfo):
                        calls[i].record_error(got)
                        fan.cancel("sibling_failed")
                        finished = True
                        await send({"type": "http.response.body", "body": body + core.sse_error(got),
                                    "more_body": False})
                        return
                    body += fmts[i].sse_chunks(got, first=False)
                    if calls[i].stream.done:
                        calls[i].record_finished()
                    else:
                        tasks[asyncio.ensure_future(calls[i].pull())] = i
        except (ClientGone, OSError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if not finished:
                fan.cancel("client_disconnected")
            fan.close()

    def _tail(self) -> bytes:
        return self.fan.fmts[0].sse_end(self.fan.usage)
