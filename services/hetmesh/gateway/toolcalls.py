"""tool_choice "auto": the model's own tool-call syntax, parsed by vLLM's parser for its family.

The cluster file names the parser per model (`tool_parser = "hermes"`); the gateway holds the whole
reply text (tool-call replies are sent whole, also when streamed), so the parser's non-streaming
`extract_tool_calls` reads it, exactly as vLLM's own server does for a non-streamed request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ToolParsing:
    """One model's vLLM tool-call parser, built once at gateway start (a wrong name fails the start)."""

    def __init__(self, name: str, tokenizer_folder: str | Path) -> None:
        from vllm.tokenizers import get_tokenizer
        from vllm.tool_parsers import ToolParserManager

        self.name = name
        self.cls = ToolParserManager.get_tool_parser(name)
        self.tokenizer = get_tokenizer(str(tokenizer_folder))
        # Some parsers need the special tokens that mark a call kept in the text (vLLM's adjust_request).
        probe = self._request({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto",
                               "tools": [{"type": "function", "function": {"name": "f"}}]})
        self.keeps_specials = not self.cls(self.tokenizer, probe.tools).adjust_request(probe).skip_special_tokens

    @staticmethod
    def _request(body: dict[str, Any]) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest.model_validate(body)

    def parse(self, text: str, body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]] | None:
        """(content, tool calls) when the text calls tools; None when it is a plain reply."""
        req = self._request(body)
        info = self.cls(self.tokenizer, req.tools).extract_tool_calls(text, req)
        if not info.tools_called or not info.tool_calls:
            return None
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": c.function.arguments}}
                 for c in info.tool_calls]
        return info.content, calls
