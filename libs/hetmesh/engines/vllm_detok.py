"""vLLM's incremental detokenizer, primed so that a prompt ending mid-character is not echoed back.

vLLM primes tokenizers' `DecodeStream` with the prompt's ids in one native prefill; in tokenizers 0.23 that
goes wrong when the prompt's text ends in an unfinished character, and the first `step` returns the whole
prompt's text. A migrated stream's prompt ends with its completion so far (a decode worker's with the
prefill's first token), so the client would get the prompt again. This primer prefills natively up to the
last point whose text ends cleanly and steps the rest, as stepping every token from the start would
(benchmarks/vllm_migration_numerics.py; upstream: vllm-project/vllm#48853). `install` puts it on the
module where vLLM looks `DecodeStream` up at each request (in the worker process).
"""

from __future__ import annotations

from typing import Any

import tokenizers.decoders

_NATIVE = tokenizers.decoders.DecodeStream
_UNFINISHED = "\ufffd"
_TAIL_SEARCH = 16  # tokens back from the end to look for a clean cut; past that, step the whole prompt
_WINDOW = 8  # tokens decoded to see whether the text up to a cut ends in an unfinished character


def clean_cut(tokenizer: Any, ids: list[int]) -> int:
    """The longest prefix of `ids` (its length) whose text does not end in an unfinished character."""
    n = len(ids)
    for back in range(min(n, _TAIL_SEARCH)):
        end = n - back
        if not tokenizer.decode(ids[max(0, end - _WINDOW):end]).endswith(_UNFINISHED):
            return end
    return 0


class PrimedDecodeStream:
    """`tokenizers.decoders.DecodeStream`'s interface as vLLM uses it (constructor, `step`)."""

    __slots__ = ("_prompt", "_skip", "_stream")

    def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = False) -> None:
        self._prompt = list(ids or ())
        self._skip = skip_special_tokens
        self._stream: Any = None

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        if self._stream is None:  # primed at the first step: the constructor is not given the tokenizer
            cut = clean_cut(tokenizer, self._prompt)
            self._stream = _NATIVE(ids=self._prompt[:cut], skip_special_tokens=self._skip)
            for t in self._prompt[cut:]:
                self._stream.step(tokenizer, t)
        return self._stream.step(tokenizer, token_id)


def stepped_text(tokenizer: Any, prompt: list[int], out: list[int]) -> str:
    """The text of `out` after `prompt` as a stream that stepped every token from the start sends it: what the
    primer must reproduce (tests, benchmarks/vllm_migration_numerics.py)."""
    s = _NATIVE(skip_special_tokens=True)
    for t in prompt:
        s.step(tokenizer, t)
    return "".join(x for t in out if (x := s.step(tokenizer, t)) is not None)


def install() -> None:
    tokenizers.decoders.DecodeStream = PrimedDecodeStream  # type: ignore[misc]
