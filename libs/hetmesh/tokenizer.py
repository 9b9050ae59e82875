"""Tokenizers the gateway and the workers share.

`byte`: UTF-8 bytes as token ids (256) plus specials; needs no files, so the sim mesh runs
anywhere, and chats are rendered in one simple `<|role|>` format. A path to a `tokenizer.json` loads
a Hugging Face `tokenizers` tokenizer (for real models and vLLM); its folder's chat template
(tokenizer_config.json / chat_template.jinja) renders chats through transformers' apply_chat_template,
with the message preparation vLLM's OpenAI server does, so the engine sees the prompt vLLM would give it.
Both expose the same small surface.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

Message = dict[str, Any]  # an OpenAI chat message: role, content (text or None), name, tool_calls, tool_call_id


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def decode_one(self, token_id: int) -> str:
        """One token's own text, specials included (logprobs name tokens by it)."""
        ...

    def generation_vocab(self) -> Sequence[int]:
        """Ids a simulated engine may emit: each decodes on its own to printable text."""
        ...

    @property
    def has_chat_template(self) -> bool:
        """A model's own template (it can render tools and template kwargs), not the simple format."""
        ...

    def render_chat(self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of a chat; ValueError when the template refuses the messages."""
        ...


def render_chat(messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """A fixed chat template (role, content) -> prompt, ending with the assistant's turn."""
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
    return text + "<|assistant|>\n" if add_generation_prompt else text


def _simple(messages: list[Message], add_generation_prompt: bool, continue_final_message: bool) -> str:
    pairs = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):  # the simple format has no slot for them: their JSON follows the text
            content += json.dumps(m["tool_calls"])
        pairs.append((m["role"], content))
    text = render_chat(pairs, add_generation_prompt)
    if continue_final_message and pairs:
        text = text[:-1]  # no newline after the last message: the completion continues it
    return text


def vllm_conversation(messages: list[Message], template: str) -> list[Message]:
    """OpenAI messages as vLLM's server hands them to a template: tool-call arguments as dicts, and
    `developer` turned into `system` (merged into one first message) where the template has no such role."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c["function"])
                try:
                    args = json.loads(f.get("arguments") or "{}")
                except ValueError:
                    args = {}
                f["arguments"] = args if isinstance(args, dict) else {}
                calls.append({**c, "function": f})
            m["tool_calls"] = calls
        elif "tool_calls" in m:
            del m["tool_calls"]
        if m.get("content") is None:
            m["content"] = ""
        if m["role"] == "developer":
            m["tools"] = None  # vLLM gives developer turns a tools slot (dropped again below if made system)
        out.append(m)
    if any(m["role"] == "developer" for m in out) and "'developer'" not in template \
            and '"developer"' not in template:
        for m in out:
            if m["role"] == "developer":
                m["role"] = "system"
                del m["tools"]
        systems = [i for i, m in enumerate(out) if m["role"] == "system"]
        if systems and (systems[0] > 0 or len(systems) > 1):
            merged = {"role": "system", "content": "\n\n".join(out[i]["content"] for i in systems if out[i]["content"])}
            out = [merged, *(m for m in out if m["role"] != "system")]
    return out


# apply_chat_template's own arguments: chat_template_kwargs cannot override them (vLLM filters them out too).
_RESERVED = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})

_PRINTABLE = set(string.ascii_letters + string.digits + " ")


class ByteTokenizer:
    vocab_size = 258
    eos_id = 256
    bos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def decode_one(self, token_id: int) -> str:
        if token_id < 256:
            return bytes([token_id]).decode("utf-8", errors="replace")
        return "</s>" if token_id == self.eos_id else "<s>"

    def generation_vocab(self) -> Sequence[int]:
        return tuple(sorted(ord(c) for c in _PRINTABLE))

    has_chat_template = False

    def render_chat(self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    kwargs: dict[str, Any] | None = None) -> str:
        return _simple(messages, add_generation_prompt, continue_final_message)


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
        self.folder = Path(path).parent
        self._hf: Any = None  # transformers' tokenizer of the folder, loaded on the first chat

    @property
    def has_chat_template(self) -> bool:
        d = self.folder
        if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
            return True
        cfg = d / "tokenizer_config.json"
        return cfg.is_file() and "chat_template" in json.loads(cfg.read_text())

    def render_chat(self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    kwargs: dict[str, Any] | None = None) -> str:
        if not self.has_chat_template:
            return _simple(messages, add_generation_prompt, continue_final_message)
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        hf = self._hf
        template = hf.get_chat_template(None, tools)
        extra = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED}
        try:
            return hf.apply_chat_template(vllm_conversation(messages, template), tools=tools, tokenize=False,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, **extra)
        except Exception as exc:  # jinja's raise_exception and template errors: the messages are refused
            raise ValueError(str(exc)) from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_one(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

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
