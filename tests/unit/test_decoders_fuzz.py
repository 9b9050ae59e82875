"""Hypothesis on the message decoders every subscription uses (hetmesh.bus.decoder): arbitrary bytes,
arbitrary JSON, and JSON close to each message's shape decode or raise msgspec's DecodeError —
nothing else — and every message survives an encode/decode round trip."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh import protocol as p
from hetmesh.bus import decode_events, decoder, encode

KINDS: list[Any] = [p.InferenceRequest, p.SubmitReply, p.WorkItem, p.ResponseEvent, p.Cancel, p.FinishedBatch,
                    p.Heartbeat, p.KvEvent, p.KvResync, p.KvTransferRequest, p.KvTransferAccept, p.KvLanded,
                    p.SchedulerStatus, p.EventBatch]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=10))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=5), max_leaves=12)
FIELDS = sorted({f for k in KINDS if isinstance(k, type) and issubclass(k, msgspec.Struct)
                 for f in k.__struct_fields__} | {"type", "request_id", "tokens", "error", "lost"})
# Objects with the messages' own field names (and the union's tag) but values of any type.
near_misses = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)


def decodes_or_refuses(kind: Any, data: bytes) -> None:
    try:
        decoder(kind).decode(data)
    except msgspec.DecodeError:  # ValidationError is a DecodeError
        pass


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: getattr(k, "__name__", str(k)))
@settings(max_examples=80, deadline=None)
@given(data=st.one_of(st.binary(max_size=200), json_values.map(msgspec.json.encode),
                      near_misses.map(msgspec.json.encode), st.lists(near_misses, max_size=3).map(msgspec.json.encode)))
def test_decoders_only_refuse_with_decode_error(kind: Any, data: bytes) -> None:
    decodes_or_refuses(kind, data)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=100) | json_values.map(msgspec.json.encode))
def test_event_batches_refuse_cleanly(data: bytes) -> None:
    try:
        decode_events(data)
    except msgspec.DecodeError:
        pass


texts = st.text(max_size=20)
ids = st.lists(st.integers(0, 2**63 - 1), max_size=8)
sampling = st.builds(p.SamplingParams, max_tokens=st.integers(1, 10**6), temperature=st.floats(0, 2),
                     top_p=st.floats(0, 1), seed=st.none() | st.integers(0, 2**63 - 1),
                     stop=st.lists(texts, max_size=4), ignore_eos=st.booleans())
requests = st.builds(p.InferenceRequest, request_id=texts, model=texts, prompt_tokens=ids, block_hashes=ids,
                     sampling=sampling, reply_subject=texts, arrival_ts=st.floats(0, 2e9),
                     attempt=st.integers(0, 5), exclude_workers=st.lists(texts, max_size=3))
errors = st.builds(p.ErrorInfo, message=texts, type=texts, code=st.none() | texts, param=st.none() | texts,
                   status=st.integers(100, 599), retry_after_s=st.none() | st.floats(0, 3600))
chunks = st.builds(p.TokenChunk, request_id=texts, worker_id=texts, index=st.integers(0, 10**6), token_ids=ids,
                   text=texts, finish_reason=st.none() | st.sampled_from(["stop", "length", "abort"]))


@settings(max_examples=100, deadline=None)
@given(msg=st.one_of(requests, chunks,
                     st.builds(p.RequestError, request_id=texts, error=errors, retryable=st.booleans()),
                     st.builds(p.WorkerLost, request_id=texts, worker_id=texts),
                     st.builds(p.Cancel, request_id=texts, reason=texts),
                     st.builds(p.KvEvent, worker_id=texts, model=texts, stored=ids, removed=ids,
                               cleared=st.booleans(), ts=st.floats(0, 2e9))))
def test_messages_round_trip(msg: msgspec.Struct) -> None:
    kind: Any = p.ResponseEvent if isinstance(msg, p.TokenChunk | p.RequestError | p.WorkerLost) else type(msg)
    assert decoder(kind).decode(encode(msg)) == msg
