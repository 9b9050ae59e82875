"""What OpenAI fidelity costs the gateway per request and per token: `python benchmarks/openai_params_cost.py`.

In-process, no mesh: parsing and checking a body (pydantic + gateway/params.py) for a plain chat, one
with sampling options, logprobs and n, and a list of completions prompts; then the SSE bytes of one
token plain and with top-5 logprobs (core.Formatter). CPU time per call (process time: wall time counts
preemption on a busy box). Prints a table and writes results/openai_params_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from hetmesh.config import ModelConfig
from hetmesh.gateway.core import Formatter
from hetmesh.gateway.params import prepare_chat, prepare_completion
from hetmesh.gateway.schemas import ChatCompletionRequest, CompletionRequest
from hetmesh.protocol import TokenChunk, TokenLogprob
from hetmesh.tokenizer import ByteTokenizer

MODEL = ModelConfig(name="m", max_context=4096)
TOK = ByteTokenizer()
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain KV caches. " * 20}]
BODIES: dict[str, tuple[bool, dict[str, Any]]] = {
    "chat, plain": (True, {"model": "m", "messages": MSGS, "max_tokens": 64}),
    "chat, options+logprobs+n=4": (True, {"model": "m", "messages": MSGS, "max_tokens": 64, "n": 4, "seed": 1,
                                          "temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.5,
                                          "frequency_penalty": 0.5, "logit_bias": {"97": 2}, "logprobs": True,
                                          "top_logprobs": 5, "stop": ["\n\n"], "user": "u",
                                          "stream": True, "stream_options": {"include_usage": True}}),
    "completions, 4 prompts, echo": (False, {"model": "m", "prompt": ["a b c " * 40] * 4, "max_tokens": 64,
                                             "echo": True}),
}


def per_call(fn: Any, seconds: float) -> float:
    """Process-CPU microseconds per call of fn, over about `seconds`."""
    n = 0
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        for _ in range(50):
            fn()
        n += 50
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=1.0, help="CPU time per measurement")
    ap.add_argument("--out", default="results/openai_params_cost.json")
    args = ap.parse_args()
    rows = []
    for name, (chat, body) in BODIES.items():
        raw = json.dumps(body).encode()
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        prep = prepare_chat if chat else prepare_completion

        def run(raw: bytes = raw, model_cls: Any = model_cls, prep: Any = prep) -> None:
            prep(model_cls.model_validate_json(raw), MODEL, TOK)  # type: ignore[attr-defined]

        rows.append({"what": f"body -> mesh requests: {name}", "us": round(per_call(run, args.seconds), 2)})
    base = ChatCompletionRequest.model_validate(BODIES["chat, plain"][1])
    plain = prepare_chat(base, MODEL, TOK)
    lp = prepare_chat(ChatCompletionRequest.model_validate({**BODIES["chat, plain"][1], "logprobs": True,
                                                            "top_logprobs": 5}), MODEL, TOK)
    top = [(t, -1.5) for t in range(97, 102)]
    chunk = TokenChunk(request_id="r", worker_id="w", index=3, token_ids=[104], text="h")
    lp_chunk = TokenChunk(request_id="r", worker_id="w", index=3, token_ids=[104], text="h",
                          logprobs=[TokenLogprob(104, -1.2, top)])
    f_plain = Formatter(True, "chatcmpl-x", "m", 1, False, plain)
    f_lp = Formatter(True, "chatcmpl-x", "m", 1, False, lp, TOK.decode_one)
    rows.append({"what": "one token's SSE chunk, plain", "us": round(per_call(
        lambda: f_plain.sse_chunks([chunk], False), args.seconds), 2)})
    rows.append({"what": "one token's SSE chunk, top-5 logprobs", "us": round(per_call(
        lambda: f_lp.sse_chunks([lp_chunk], False), args.seconds), 2)})
    width = max(len(r["what"]) for r in rows)
    print(f"{'':{width}}  CPU us")
    for r in rows:
        print(f"{r['what']:{width}}  {r['us']:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                         "python": platform.python_version(),
                                                         "note": "2 cores shared with other agents' work"}},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
