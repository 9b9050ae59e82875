"""Tokenizers the gateway and the workers share.

`byte`: UTF-8 bytes as token ids (256) plus specials; needs no files, so the sim mesh runs
anywhere. A path to a `tokenizer.json` loads a Hugging Face `tokenizers` tokenizer (for
real models and vLLM). Both expose the same small surface.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def generation_vocab(self) -> Sequence[int]:
        """Ids a simulated engine may emit: each decodes on its own to printable text."""
        ...


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """A fixed chat template (role, content) -> prompt, ending with the assistant's turn."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


_PRINTABLE = set(string.ascii_letters + string.digits + " ")


class ByteTokenizer:
    vocab_size = 258
    eos_id = 256
    bos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def generation_vocab(self) -> Sequence[int]:
        return tuple(sorted(ord(c) for c in _PRINTABLE))


class HFTokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        eos = None
        for name in ("</s>", "<|endoftext|>", "<|eot_id|>", "<eos>"):
            eos = self._tok.token_to_id(name)
            if eos is not None:
                break
        self.eos_id = eos if eos is not None else self.vocab_size - 1
        self._gen: tuple[int, ...] | None = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def generation_vocab(self) -> Sequence[int]:
        if self._gen is None:
            ok = [i for i in range(self.vocab_size)
                  if (s := self._tok.decode([i])) and all(c in _PRINTABLE for c in s)]
            self._gen = tuple(ok)
        return self._gen


@lru_cache(maxsize=16)
def load(spec: str) -> Tokenizer:
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
