"""Incremental detokenization: text for each new token in constant work.

Decoding a request's whole output after every token costs time quadratic
in its length. A `Detokenizer` feeds each token to the tokenizer's
incremental decoder (`decode_stream`: tokenizers' DecodeStream, which holds
a multi-byte character back until all its bytes are in), looks for stop
strings only where a new one could end, and holds back text that could
still become a stop string, so a stream never shows a client the start of a
stop string it then takes back. Every step touches a bounded amount of text
(the new piece and the longest stop string's length before it).
"""

from __future__ import annotations

CONTEXT_TOKENS = 6      # prompt tokens that give the first output token its context


class Detokenizer:
    __slots__ = ("_step", "stop", "include_stop", "longest_stop", "stopped", "_out",
                 "_pending", "_recent")

    def __init__(self, tokenizer, prompt_tail=(), stop=(), include_stop: bool = False,
                 skip_special: bool = True):
        """`include_stop`: the text ends after the stop string found, not
        before it (vLLM's include_stop_str_in_output). `skip_special`: special
        tokens add no text (False: their own text, e.g. <|im_start|>)."""
        self._step = tokenizer.decode_stream(list(prompt_tail[-CONTEXT_TOKENS:]),
                                             skip_special_tokens=skip_special).step
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.stopped = False        # a stop string was found; the text ends before it
        self._out: list[str] = []   # text handed out by ready()
        self._pending = ""          # text not handed out yet (held back, or not asked for)
        self._recent = ""           # the text's last longest_stop - 1 chars (while not stopped)

    @property
    def text(self) -> str:
        """The whole output's text so far (cut at a stop string)."""
        return "".join(self._out) + self._pending

    def push(self, token: int, check_stop: bool = True) -> bool:
        """Add one token; True if a stop string now appears in the text.
        `check_stop=False` (before min_tokens) adds text without looking."""
        if self.stopped:
            return True
        piece = self._step(token)
        if not piece:
            return False            # part of a character: wait for the next token
        if not (self.stop and check_stop):
            self._add(piece)
            return False
        # a stop string that ends in this piece starts at most longest-1 chars before
        # it; one that ended before it (before min_tokens: not looked for) does not count
        before = self._recent
        window = before + piece
        found = [(i, -len(s)) for i, s in
                 ((window.find(s, max(len(before) - len(s) + 1, 0)), s) for s in self.stop)
                 if i >= 0]
        if not found:
            self._add(piece)
            return False
        self.stopped = True
        cut, minus_len = min(found)  # the first to start (the longest of those)
        if self.include_stop:
            cut -= minus_len        # the text ends with the stop string
        keep = cut - len(before)    # chars of `piece` the text keeps (may be < 0)
        if keep >= 0:
            self._pending += piece[:keep]
        else:                       # it began in text not handed out yet, or in text out
            drop = -keep
            held = len(self._pending)
            self._pending = self._pending[:held - min(drop, held)]
        return True

    def skip(self, chars: int) -> None:
        """The first `chars` characters of the text not handed out yet are
        out already (sent by the engine a resubmitted request came from)."""
        self._pending = self._pending[chars:]

    def _add(self, piece: str) -> None:
        self._pending += piece
        n = self.longest_stop - 1
        if n > 0:
            self._recent = (self._recent + piece)[-n:]

    def ready(self, final: bool = False) -> str:
        """Text not handed out yet. Unless `final`, a tail that is the start
        of a stop string stays back."""
        text = self._pending
        keep = 0
        if not final and self.stop and not self.stopped:
            keep = _held_back(self._recent, self.stop)
        out = text[:len(text) - keep] if keep else text
        if out:
            self._out.append(out)
        self._pending = text[len(out):]
        return out


def _held_back(tail: str, stops) -> int:
    """Length of the longest end of `tail` that begins some stop string."""
    best = 0
    for s in stops:
        i = tail.find(s[0])
        while i >= 0 and len(tail) - i > best:
            if s.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return best
