"""Every malformed or unservable request gets OpenAI's error shape and the right status; the
gateway process stays up through all of them."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MAX_CONTEXT, FakePeer, GatewayProc

MSG = [{"role": "user", "content": "hello"}]


def post(gw: GatewayProc, path: str, body: bytes | dict[str, object]) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(gw.url + path, content=body, headers={"content-type": "application/json"}, timeout=10)
    return httpx.post(gw.url + path, json=body, timeout=10)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                        type_: str = "invalid_request_error") -> dict[str, object]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type_
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture
def client(gateway: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"model": "tiny", "messages": [', b"\xff\xfe"])
def test_malformed_json(gateway: GatewayProc, raw: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert_openai_error(post(gateway, path, raw), 400)


def test_body_not_an_object(gateway: GatewayProc) -> None:
    assert_openai_error(post(gateway, "/v1/chat/completions", b"[1, 2]"), 400)


BAD_JSON_START = "We could not parse the JSON body of your request."


@pytest.mark.parametrize("path,raw", [
    # A bare NaN or Infinity is not JSON: OpenAI refuses the body, not the value's range.
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": NaN}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                             b'"logit_bias": {"5": -Infinity}}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
                             b'"function", "function": {"name": "f", "parameters": {"maximum": NaN}}}]}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, 2, NaN]}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "frequency_penalty": -Infinity}'),
])
def test_bare_nan_or_infinity_is_not_json(gateway: GatewayProc, path: str, raw: bytes) -> None:
    err = assert_openai_error(post(gateway, path, raw), 400)
    assert str(err["message"]).startswith(BAD_JSON_START), err


def test_the_word_nan_in_a_string_is_fine(gateway: GatewayProc) -> None:
    r = post(gateway, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "NaN Infinity"}],
                                                "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_tool_message_needs_its_tool_call_id(gateway: GatewayProc, client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages: list[dict[str, object]] = [{"role": "user", "content": "x"},
                                         {"role": "assistant", "content": None, "tool_calls": [call]},
                                         {"role": "tool", "content": "42"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    body = exc.value.body
    assert isinstance(body, dict)
    assert body["message"] == "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'."
    assert body["param"] == "messages[2].tool_call_id" and body["type"] == "invalid_request_error"
    messages[2]["tool_call_id"] = "call_1"
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert out.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"messages": MSG}, "model"),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": 7, "messages": MSG}, "model"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": MSG, "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "messages": MSG, "temperature": "0.5"}, "temperature"),
    ({"model": "tiny", "messages": MSG, "temperature": 2.5}, "temperature"),
    ({"model": "tiny", "messages": MSG, "temperature": -0.1}, "temperature"),
    ({"model": "tiny", "messages": MSG, "top_p": 1.5}, "top_p"),
    ({"model": "tiny", "messages": MSG, "top_p": [1]}, "top_p"),
    ({"model": "tiny", "messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    ({"model": "tiny", "messages": MSG, "max_tokens": 1.5}, "max_tokens"),
    ({"model": "tiny", "messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"model": "tiny", "messages": MSG, "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"model": "tiny", "messages": MSG, "seed": "x"}, "seed"),
    ({"model": "tiny", "messages": MSG, "n": 129}, "n"),
    ({"model": "tiny", "messages": MSG, "nn": 2}, "nn"),  # unknown: refused by name, never dropped
    ({"model": "tiny", "messages": MSG, "top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
    ({"model": "tiny", "messages": MSG, "tool_choice": "auto"}, "tool_choice"),  # needs tools
    ({"model": "tiny", "messages": MSG, "n": 0}, "n"),
    ({"model": "tiny", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "tiny", "messages": MSG, "stop": 5}, "stop"),
    ({"model": "tiny", "messages": MSG, "stream": "yes"}, "stream"),
    ({"model": "tiny", "messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_chat_parameter(gateway: GatewayProc, body: dict[str, object], param: str) -> None:
    assert_openai_error(post(gateway, "/v1/chat/completions", body), 400, param=param)


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": ["a", ""]}, "prompt[1]"),
    ({"model": "tiny", "prompt": [1, 99999]}, "prompt"),
    ({"model": "tiny", "prompt": {"text": "x"}}, "prompt"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "tiny", "prompt": ["x"] * 20, "n": 7}, "n"),  # 140 choices
])
def test_bad_completion_parameter(gateway: GatewayProc, body: dict[str, object], param: str) -> None:
    assert_openai_error(post(gateway, "/v1/completions", body), 400, param=param)


def test_unknown_model_is_404(gateway: GatewayProc, client: openai.OpenAI) -> None:
    err = assert_openai_error(post(gateway, "/v1/chat/completions", {"model": "nope", "messages": MSG}), 404,
                              param="model", code="model_not_found")
    assert "nope" in str(err["message"])
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nope", prompt="x")
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_context_length_exceeded(gateway: GatewayProc, client: openai.OpenAI) -> None:
    long = "x" * (MAX_CONTEXT + 10)
    assert_openai_error(post(gateway, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": long}]}), 400, param="messages", code="context_length_exceeded")
    assert_openai_error(post(gateway, "/v1/completions", {"model": "tiny", "prompt": long}), 400,
                        param="prompt", code="context_length_exceeded")
    # A short prompt plus a completion that would not fit.
    assert_openai_error(post(gateway, "/v1/completions", {"model": "tiny", "prompt": "abc",
                                                          "max_tokens": MAX_CONTEXT - 2}),
                        400, param="prompt", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=MAX_CONTEXT)  # type: ignore[arg-type]
    assert exc.value.code == "context_length_exceeded"


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MSG, temperature=9)  # type: ignore[arg-type]
    assert exc.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MSG, n=200)  # type: ignore[arg-type]
    assert exc.value.param == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="x", stop=["1", "2", "3", "4", "5"])
    assert exc.value.param == "stop"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MSG, stream=True, max_tokens=0)  # type: ignore[arg-type]
    assert exc.value.param == "max_tokens"


def test_unknown_route_and_wrong_method(gateway: GatewayProc) -> None:
    r = httpx.post(gateway.url + "/v1/nothing-here", json={})
    err = assert_openai_error(r, 404)
    assert "/v1/nothing-here" in str(err["message"])
    assert_openai_error(httpx.get(gateway.url + "/v1/chat/completions"), 405)
    assert_openai_error(httpx.delete(gateway.url + "/v1/models"), 405)


def test_no_live_worker_is_503(gateway: GatewayProc, client: openai.OpenAI) -> None:
    assert_openai_error(post(gateway, "/v1/chat/completions", {"model": "dead", "messages": MSG}), 503,
                        code="no_workers", type_="server_error")
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="dead", prompt="x", max_tokens=3)
    assert exc.value.status_code == 503


def test_scheduler_not_answering_is_503(gateway: GatewayProc, peer: FakePeer) -> None:
    r = post(gateway, "/v1/completions", {"model": "tiny", "prompt": "noreply", "max_tokens": 3})
    assert_openai_error(r, 503, code="scheduler_unavailable", type_="server_error")
    sub = peer.wait_for("submits", lambda s: bytes(s.prompt_tokens) == b"noreply")
    # It might still get placed late: the gateway tells the mesh to drop it.
    peer.wait_for("cancels", lambda c: c.request_id == sub.request_id and c.reason == "submit_timeout")  # type: ignore[attr-defined]


def test_scheduler_rejection_keeps_its_status(gateway: GatewayProc) -> None:
    for stream in (False, True):
        r = post(gateway, "/v1/completions", {"model": "tiny", "prompt": "reject", "max_tokens": 3, "stream": stream})
        assert_openai_error(r, 429, code="no_capacity", type_="server_error")


def test_worker_error_before_tokens(gateway: GatewayProc) -> None:
    r = post(gateway, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "fatal"}]})
    err = assert_openai_error(r, 500, code="engine_error", type_="server_error")
    assert err["message"] == "engine exploded"


def test_huge_prompt_is_a_context_error_not_a_crash(gateway: GatewayProc) -> None:
    r = post(gateway, "/v1/completions", {"model": "tiny", "prompt": "y" * 3_000_000, "max_tokens": 1})
    assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")


def test_gateway_still_up(gateway: GatewayProc) -> None:
    # Runs after the tests above (file order): nothing they sent took the process down.
    assert gateway.alive
    assert httpx.get(gateway.url + "/health").status_code == 200
    r = httpx.get(gateway.url + "/ready")
    assert r.status_code == 200 and r.json()["workers"] >= 1
