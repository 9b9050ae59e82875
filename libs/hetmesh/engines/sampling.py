"""Deterministic generation for the `sim` engine: the token stream of a request and its text.

Generated tokens are a function of (prompt tokens, seed), defined once by `Sampler` +
`Completion`; `expected_completion` runs exactly that code so tests can predict the text.
"""

from __future__ import annotations

import math
import random
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from hashlib import blake2b
from itertools import accumulate

from hetmesh.protocol import SamplingParams, TokenLogprob
from hetmesh.tokenizer import Tokenizer

# Chance that a sampled token is EOS (unless ignore_eos): mean natural length ~ 1/EOS_PROB.
EOS_PROB = 1.0 / 512


# ---------------------------------------------------------------- deterministic generation

class Sampler:
    """The token stream of one request: a PRNG seeded from the prompt and (temperature > 0) the seed.

    Each draw: EOS with probability EOS_PROB (never before `min_tokens`, never with ignore_eos), else a
    token of the generation vocabulary. By default that token is uniform; `logit_bias` and the presence /
    frequency penalties give it logits (0 plus bias minus penalties of the tokens drawn so far), divided
    by the temperature (0: the highest, ties drawn uniformly). A bias on EOS scales EOS_PROB by e^bias.
    `last` is the draw's TokenLogprob when the request asked for logprobs: the distribution drawn from.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: Sequence[int], sampling: SamplingParams) -> None:
        h = blake2b(array("q", prompt_tokens).tobytes(), digest_size=16)
        if sampling.temperature > 0:
            h.update(b"seed:%d" % (sampling.seed or 0))
        self._rng = random.Random(int.from_bytes(h.digest(), "little"))
        self._vocab = _vocab(tokenizer)
        self._eos = tokenizer.eos_id
        self._ignore_eos = sampling.ignore_eos
        self._s = sampling
        self._shaped = bool(sampling.presence_penalty or sampling.frequency_penalty
                            or any(t != self._eos for t in sampling.logit_bias))
        self._want = sampling.logprobs
        self._counts: dict[int, int] = {}
        self._drawn = 0
        self.last: TokenLogprob | None = None

    def next(self) -> int:
        # Always draw both numbers so ignore_eos does not shift the rest of the stream.
        rand = self._rng.random
        r = rand()
        u = rand()
        eos_ok = not self._ignore_eos and self._drawn >= self._s.min_tokens
        if not self._shaped and self._want is None and not self._s.logit_bias:  # the hot path
            tok = self._vocab[int(u * len(self._vocab))]
            out = self._eos if r < EOS_PROB and eos_ok else tok
        else:
            out = self._draw(r, u, eos_ok)
        self._drawn += 1
        if self._shaped:
            self._counts[out] = self._counts.get(out, 0) + 1
        return out

    def _weights(self) -> list[float]:
        """Unnormalised weights over the generation vocabulary."""
        s = self._s
        if not self._shaped:
            return [1.0] * len(self._vocab)
        counts, bias = self._counts, s.logit_bias
        logits = []
        for t in self._vocab:
            c = counts.get(t, 0)
            logits.append(bias.get(t, 0.0) - (s.presence_penalty if c else 0.0) - s.frequency_penalty * c)
        top = max(logits)
        if s.temperature <= 0:
            return [1.0 if x == top else 0.0 for x in logits]
        return [math.exp((x - top) / s.temperature) for x in logits]

    def _draw(self, r: float, u: float, eos_ok: bool) -> int:
        weights = self._weights()
        cum = list(accumulate(weights))
        total = cum[-1]
        pe = 0.0
        if eos_ok:
            pe = min(1.0, EOS_PROB * math.exp(self._s.logit_bias.get(self._eos, 0.0)))
        if r < pe:
            out = self._eos
        else:
            i = min(bisect_right(cum, u * total), len(cum) - 1)
            while weights[i] == 0.0 and i > 0:  # u * total landed on an edge next to a banned token
                i -= 1
            out = self._vocab[i]
        if self._want is not None:
            self.last = self._logprob(out, weights, total, pe)
        return out

    def _logprob(self, out: int, weights: list[float], total: float, pe: float) -> TokenLogprob:
        def lp(p: float) -> float:
            return math.log(p) if p > 0 else -9999.0  # vLLM's floor for impossible tokens

        probs = {t: (1.0 - pe) * w / total for t, w in zip(self._vocab, weights, strict=True)}
        probs[self._eos] = pe
        k = self._want or 0
        top = sorted(probs.items(), key=lambda kv: (-kv[1], kv[0]))[:k] if k else []
        return TokenLogprob(out, lp(probs[out]), [(t, lp(p)) for t, p in top])


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

    def _ends(self, tok: int) -> bool:
        """EOS (unless ignore_eos) or one of stop_token_ids; neither before min_tokens (vLLM's rule)."""
        s = self.sampling
        if len(self.token_ids) <= s.min_tokens:
            return False
        return (tok == self.tok.eos_id and not s.ignore_eos) or tok in s.stop_token_ids

    def append(self, tok: int) -> str:
        """Add a token; return the newly emittable text."""
        self.token_ids.append(tok)
        if not self.stops:  # fast path: no hold-back, nothing to search
            piece = ""
            if self._ends(tok):
                self.finish_reason = "stop"
            else:
                piece = _piece(self.tok, tok)
                self._parts.append(piece)
            if self.finish_reason is None and len(self.token_ids) >= self.sampling.max_tokens:
                self.finish_reason = "length"
            return piece
        if self._ends(tok):
            self.finish_reason = "stop"
        else:
            self.text += _piece(self.tok, tok)
            cut = -1
            for s in self.stops if len(self.token_ids) > self.sampling.min_tokens else ():
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
