"""Deterministic generation for the `sim` engine: the token stream of a request and its text.

Generated tokens are a function of (prompt tokens, seed), defined once by `Sampler` +
`Completion`; `expected_completion` runs exactly that code so tests can predict the text.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from hashlib import blake2b

from hetmesh.protocol import SamplingParams
from hetmesh.tokenizer import Tokenizer

# Chance that a sampled token is EOS (unless ignore_eos): mean natural length ~ 1/EOS_PROB.
EOS_PROB = 1.0 / 512


# ---------------------------------------------------------------- deterministic generation

class Sampler:
    """The token stream of one request: a PRNG seeded from the prompt and (temperature > 0) the seed."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: Sequence[int], sampling: SamplingParams) -> None:
        h = blake2b(array("q", prompt_tokens).tobytes(), digest_size=16)
        if sampling.temperature > 0:
            h.update(b"seed:%d" % (sampling.seed or 0))
        self._rng = random.Random(int.from_bytes(h.digest(), "little"))
        self._vocab = _vocab(tokenizer)
        self._eos = tokenizer.eos_id
        self._ignore_eos = sampling.ignore_eos

    def next(self) -> int:
        # Always draw both numbers so ignore_eos does not shift the rest of the stream.
        rand = self._rng.random
        r = rand()
        tok = self._vocab[int(rand() * len(self._vocab))]
        return self._eos if r < EOS_PROB and not self._ignore_eos else tok


_piece_cache: dict[tuple[int, int], str] = {}
_vocab_cache: dict[int, tuple[Tokenizer, Sequence[int]]] = {}


def _vocab(tokenizer: Tokenizer) -> Sequence[int]:
    # Keyed by id() but holding the tokenizer, so a key is never reused by another object.
    hit = _vocab_cache.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = _vocab_cache[id(tokenizer)] = (tokenizer, tuple(tokenizer.generation_vocab()))
    return hit[1]


def _piece(tokenizer: Tokenizer, tok: int) -> str:
    key = (id(tokenizer), tok)
    s = _piece_cache.get(key)
    if s is None:
        s = _piece_cache[key] = tokenizer.decode([tok])
    return s


class Completion:
    """Detokenizing, stop strings, eos and max_tokens for one request.

    Text that might be the start of a stop string is held back until it is known not to be;
    a matched stop string and everything after it is never emitted.
    """

    def __init__(self, tokenizer: Tokenizer, sampling: SamplingParams) -> None:
        self.tok = tokenizer
        self.sampling = sampling
        self.stops = [s for s in sampling.stop if s]
        self.token_ids: list[int] = []
        self.text = ""  # the full text so far (with stop strings; without them see `output_text`)
        self._parts: list[str] = []  # the text as pieces (no stop strings)
        self.emitted = 0  # len of text already handed out
        self.finish_reason: str | None = None

    @property
    def output_text(self) -> str:
        return self.text if self.stops else "".join(self._parts)

    def _holdback(self) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.emitted), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def append(self, tok: int) -> str:
        """Add a token; return the newly emittable text."""
        self.token_ids.append(tok)
        if not self.stops:  # fast path: no hold-back, nothing to search
            piece = ""
            if tok == self.tok.eos_id and not self.sampling.ignore_eos:
                self.finish_reason = "stop"
            else:
                piece = _piece(self.tok, tok)
                self._parts.append(piece)
            if self.finish_reason is None and len(self.token_ids) >= self.sampling.max_tokens:
                self.finish_reason = "length"
            return piece
        if tok == self.tok.eos_id and not self.sampling.ignore_eos:
            self.finish_reason = "stop"
        else:
            self.text += _piece(self.tok, tok)
            cut = -1
            for s in self.stops:
                p = self.text.find(s, self.emitted)
                if p >= 0 and (cut < 0 or p < cut):
                    cut = p
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.token_ids) >= self.sampling.max_tokens:
            self.finish_reason = "length"
        end = len(self.text) if self.finish_reason else len(self.text) - self._holdback()
        new = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return new


def expected_completion(
    tokenizer: Tokenizer, prompt_tokens: Sequence[int], sampling: SamplingParams
) -> tuple[list[int], str, str]:
    """(token_ids, text, finish_reason) the sim engine produces for this prompt: its own definition."""
    sampler = Sampler(tokenizer, prompt_tokens, sampling)
    comp = Completion(tokenizer, sampling)
    while comp.finish_reason is None:
        comp.append(sampler.next())
    return comp.token_ids, comp.output_text, comp.finish_reason
