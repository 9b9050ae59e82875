"""Random request bodies against the real gateway: every answer is a success or an OpenAI-shaped
error with a 4xx status, and every service of the mesh stays up."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetmesh.launcher import Mesh

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def mostly(valid: st.SearchStrategy[object], invalid: st.SearchStrategy[object] = json_values) -> st.SearchStrategy[object]:
    """Valid about four times in five, so that a fair share of bodies is valid as a whole
    (a plain one_of lets hypothesis favour the invalid branch)."""
    return st.integers(0, 99).flatmap(lambda i: invalid if i % 5 == 4 else valid)


# Small generation lengths only: a valid huge max_tokens would just be a long, correct run.
max_tokens = mostly(st.integers(1, 6), st.one_of(st.integers(-3, 0), st.text(max_size=4), st.floats(allow_nan=False)))
text = st.text(st.characters(codec="utf-8"), max_size=40)
message = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "system", "assistant"]),
                                                st.sampled_from(["robot", "", "tool"])),
                                 "content": mostly(text)})
sampling = {"temperature": mostly(st.floats(0, 2)), "top_p": mostly(st.floats(0.01, 1)),
            "seed": mostly(st.integers(0, 2**31)), "stop": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=4)),
            "stream": st.booleans(), "n": mostly(st.integers(1, 3), st.integers(-1, 200)),
            "presence_penalty": mostly(st.floats(-2, 2)), "frequency_penalty": mostly(st.floats(-2, 2)),
            "logit_bias": mostly(st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3)),
            "min_tokens": mostly(st.integers(0, 3)), "stop_token_ids": mostly(st.lists(st.integers(0, 300), max_size=2)),
            "ignore_eos": st.booleans()}
tool = st.fixed_dictionaries({"type": mostly(st.just("function")), "function": st.fixed_dictionaries(
    {"name": mostly(st.sampled_from(["f", "get_weather"])), "parameters": mostly(st.just({"type": "object"}))})})
chat_extra = {"logprobs": mostly(st.booleans()), "top_logprobs": mostly(st.integers(0, 20), st.integers(-1, 30)),
              "response_format": mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
              "tools": mostly(st.lists(tool, max_size=2)),
              "tool_choice": mostly(st.sampled_from(["none", "auto", "required"])),
              "unknown_field": json_values}
chat_bodies = st.fixed_dictionaries(
    {"model": mostly(st.sampled_from(["tiny-agg", "tiny-pd"]), st.one_of(st.just("nope"), json_values)),
     "messages": mostly(st.lists(message, min_size=1, max_size=3)),
     # Always given: left out it defaults to the rest of the context, a long (correct) run.
     "max_tokens": max_tokens},
    optional={"max_completion_tokens": max_tokens, **sampling, **chat_extra,
              "stream_options": mostly(st.just({"include_usage": True})), "user": mostly(st.text(max_size=8))},
)
completion_bodies = st.fixed_dictionaries(
    {"model": mostly(st.sampled_from(["tiny-agg", "tiny-pd"]), json_values),
     "prompt": mostly(st.one_of(text.filter(bool), st.lists(st.integers(0, 255), min_size=1, max_size=8),
                                st.lists(text.filter(bool), min_size=1, max_size=3),
                                st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=4), min_size=1, max_size=2)),
                      st.one_of(st.lists(st.integers(-5, 10**6), max_size=8), json_values)),
     "max_tokens": max_tokens},
    optional={**sampling, "echo": mostly(st.booleans()), "logprobs": mostly(st.integers(0, 5), st.integers(-1, 30)),
              "best_of": mostly(st.integers(1, 3)), "suffix": mostly(st.text(max_size=3))},
)
ALLOWED = {200, 400, 404, 413, 422}


def check(mesh: Mesh, http: httpx.Client, path: str, body: object) -> None:
    stream = isinstance(body, dict) and body.get("stream") is True
    r = http.post(f"{mesh.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code in ALLOWED, (r.status_code, r.text[:300])
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and {"type", "param", "code"} <= set(err)
    elif stream:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=chat_bodies)
def test_random_chat_bodies(mesh: Mesh, body: dict[str, object]) -> None:
    with httpx.Client(timeout=30) as http:
        check(mesh, http, "/v1/chat/completions", body)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=mostly(completion_bodies))
def test_random_completion_bodies(mesh: Mesh, body: object) -> None:
    with httpx.Client(timeout=30) as http:
        check(mesh, http, "/v1/completions", body)


def test_mesh_still_whole_after_fuzzing(mesh: Mesh) -> None:
    assert all(s.alive for s in mesh.services.values())
    assert httpx.get(f"{mesh.url}/ready").status_code == 200
