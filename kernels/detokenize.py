"""Incremental detokenization: text for each new token in constant work.

Decoding a request's whole output after every token costs time quadratic
in its length. A `Detokenizer` decodes only a short window: the tokens
since the last text it was sure of (`prefix`), with and without the new
ones, and emits the difference. A window that ends in U+FFFD (part of a
multi-byte character) emits nothing until the character completes.

Stop strings are found in the tail of the text, and text that could still
become a stop string is held back from `ready()` until it cannot, so a
stream never shows a client the start of a stop string it then takes back.
"""

from __future__ import annotations

CONTEXT_TOKENS = 6      # prompt tokens decoded with the first output tokens


class Detokenizer:
    __slots__ = ("tok", "ids", "prefix", "read", "text", "stop", "longest_stop", "stopped",
                 "_sent", "_scanned")

    def __init__(self, tokenizer, prompt_tail=(), stop=()):
        self.tok = tokenizer
        # a few prompt tokens give the first output token its context (a
        # leading space, a merge across the boundary), never emitted themselves
        self.ids = list(prompt_tail[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""              # the output's text so far (cut at a stop string)
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.stopped = False        # a stop string was found; text ends before it
        self._sent = 0              # chars of text handed out by ready()
        self._scanned = 0           # text before this offset holds no stop string

    def push(self, token: int, check_stop: bool = True) -> bool:
        """Add one token; True if a stop string now appears in the text.
        `check_stop=False` (before min_tokens) adds text without looking."""
        if self.stopped:
            return True
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False            # nothing printable yet: wait for the next token
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        if not (self.stop and check_stop):
            self._scanned = len(self.text)
            return False
        start = max(self._scanned - self.longest_stop + 1, 0)
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0),
                  default=-1)
        self._scanned = len(self.text)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
        return self.stopped

    def ready(self, final: bool = False) -> str:
        """Text not handed out yet. Unless `final`, a tail that is the start
        of a stop string stays back."""
        end = len(self.text)
        if not final and self.stop and not self.stopped:
            end -= _held_back(self.text, self.stop, self.longest_stop)
        out = self.text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out


def _held_back(text: str, stops, longest: int) -> int:
    """Length of the longest tail of `text` that begins some stop string."""
    for n in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0
