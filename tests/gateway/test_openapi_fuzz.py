"""Schemathesis against the real gateway's own OpenAPI document (/openapi.json): for every operation,
requests generated from the document, both valid ones and ones that break it on purpose (wrong
types, missing fields, out-of-range numbers, odd strings). Each answer is a success or an
OpenAI-shaped error, nothing is a 500, and the gateway stays up. The scripted peer plays scheduler
and workers, so generation lengths are bounded by the model's 256-token context and every valid
request finishes fast."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from .conftest import GatewayProc

EXAMPLES = 30  # per operation and mode


# What the sim-served model honours whatever the value (the rest of the declared parameters are refused by
# design there: tools, structured outputs, audio, ...; or fan out: n, lists of prompts).
SERVABLE = {"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "user",
            "presence_penalty", "frequency_penalty", "ignore_eos", "metadata", "safety_identifier", "prompt_cache_key",
            "parallel_tool_calls", "logprobs"}


def served_model(pair: tuple[schemathesis.Case, bool]) -> schemathesis.Case:
    """Half the bodies name the served model and keep only what it serves (SERVABLE; lengths within the
    256-token context): otherwise a generated body is almost never servable."""
    case, name_it = pair
    if name_it and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "tiny"
        for k in set(case.body) - SERVABLE:
            case.body.pop(k)
        for m in case.body.get("messages") or ():
            if isinstance(m, dict):  # fields and roles refused by design (audio, the deprecated functions)
                m.pop("audio", None)
                m.pop("function_call", None)
                if m.get("role") == "function":
                    m["role"] = "user"
        case.body["max_tokens"] = 4
        if not isinstance(case.body.get("prompt", ""), str):
            case.body["prompt"] = "fuzz"
    return case


def check(case: schemathesis.Case, gateway: GatewayProc) -> int:
    r = case.call(base_url=gateway.url, timeout=30)
    # 503 only for the model that has no workers (the cluster's "dead" model)
    assert r.status_code < 500 or (r.status_code == 503 and "dead" in r.text), (r.status_code, r.text[:300])
    if r.status_code >= 400 and case.path.startswith("/v1"):
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and {"type", "param", "code"} <= set(err)
    return r.status_code


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_success_or_an_openai_error(gateway: GatewayProc, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    labels = []
    statuses: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        labels.append(op.label)
        if mode is GenerationMode.NEGATIVE and not len(op.body):
            continue  # only a body can be wrong (a path string is always a string)

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)  # the same cases every run: CI must not pass or fail by luck
        @given(case=st.tuples(op.as_strategy(generation_mode=mode), st.booleans()).map(served_model))
        def run(case: schemathesis.Case) -> None:
            statuses.setdefault(case.operation.label, set()).add(check(case, gateway))

        run()
        assert gateway.alive, op.label
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= set(labels)
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):  # the fuzzing reached both outcomes
        seen = statuses[label]
        assert (200 in seen) if mode is GenerationMode.POSITIVE else any(400 <= c < 500 for c in seen), (label, seen)
    assert httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200
