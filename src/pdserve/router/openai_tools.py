"""A chat choice's tool calls on the wire: `message.tool_calls` whole, or
streamed as `delta.tool_calls` the way OpenAI's API streams them (the
call's index, id, type and name in its first delta, argument fragments
after it, concatenated by index), and `finish_reason: tool_calls`.

A named function's output is its arguments, so they stream as they are
generated. Under auto, text before the format's opening mark streams as
content; a call in a format that closes each one (Hermes / Qwen
`<tool_call>...</tool_call>`) goes out whole as soon as it closes, and the
rest (a `required` array, Llama 3's and Mistral's calls) is parsed once the
choice ends."""

from __future__ import annotations

from pdserve.text.tools import Choice, ToolCall, ToolFormat, ToolUse, new_call_id

HERMES_CLOSE = "</tool_call>"


def finish_reason(calls: list, finish: str | None) -> str | None:
    return "tool_calls" if calls and finish == "stop" else finish


def message(use: ToolUse, fmt: ToolFormat, text: str, finish: str | None) -> tuple[dict, str | None]:
    """A whole choice's message and finish reason."""
    content, calls = use.calls_from(text, fmt)
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.wire() for c in calls]
    return msg, finish_reason(calls, finish)


class ToolDeltas:
    """One streamed choice: each text delta in, the deltas to send out."""

    def __init__(self, use: ToolUse, fmt: ToolFormat):
        self.use, self.fmt = use, fmt
        self.text = ""              # everything generated
        self.sent = 0               # characters of it sent as content
        self.named_id = new_call_id() if use.choice is Choice.NAMED else ""
        self.started = False
        self.calls: list[ToolCall] = []     # sent already, each the moment it closed
        self.closed = 0                     # characters of text whose closed calls went out

    def push(self, text: str, finish: str | None) -> tuple[list[dict], str | None]:
        """(deltas to send, the finish reason to send with the last; None:
        not finished)."""
        self.text += text
        if self.use.choice is Choice.NAMED:
            out: list[dict] = []
            if not self.started:
                self.started = True
                out.append({"tool_calls": [ToolCall(self.use.named or "", "", self.named_id)
                                           .wire(0)]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out, finish_reason([1], finish) if finish else None
        if finish is None:
            return self._content() + self._closed_calls(), None
        content, calls = self.use.calls_from(self.text, self.fmt)
        if not calls:
            return self._content(final=True), finish
        out = []
        if content and len(content) > self.sent:
            out.append({"content": content[self.sent:]})
        n = len(self.calls)                 # those are the first n of `calls`, ids and all
        out += [{"tool_calls": [c.wire(i)]} for i, c in enumerate(calls[n:], start=n)]
        return out, finish_reason(calls, finish)

    def _closed_calls(self) -> list[dict]:
        """Auto with a closing mark: each call that closed since the last
        push, parsed as the end will parse it (an ill-formed one stays
        unsent, as it will be skipped then)."""
        if self.use.choice is not Choice.AUTO or self.fmt is not ToolFormat.HERMES:
            return []
        out = []
        while (end := self.text.find(HERMES_CLOSE, self.closed)) >= 0:
            body = self.text[self.closed:end + len(HERMES_CLOSE)]
            self.closed = end + len(HERMES_CLOSE)
            _, calls = self.use.calls_from(body[body.find(self.fmt.start):], self.fmt)
            for c in calls:
                out.append({"tool_calls": [c.wire(len(self.calls))]})
                self.calls.append(c)
        return out

    def _content(self, final: bool = False) -> list[dict]:
        """Content up to a possible call's opening mark (all of it at the
        end, when no call was found)."""
        if self.use.choice is Choice.REQUIRED and not final:
            return []
        end = len(self.text)
        if not final:
            mark = self.fmt.start
            at = self.text.find(mark, self.sent)
            if at >= 0:
                end = at
            else:                       # a mark may be starting at the very end
                for k in range(min(len(mark) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(mark[:k]):
                        end = len(self.text) - k
                        break
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:end], end
        return [{"content": piece}]
