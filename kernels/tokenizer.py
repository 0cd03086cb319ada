"""Tokenizers: Hugging Face's `tokenizers` for checkpoints, bytes for tiny."""

from __future__ import annotations

from pathlib import Path


class PrintableTokenizer:
    """The tiny preset's tokenizer: one id per printable ASCII character
    (0..94 for ' '..'~'), 95 for a newline, 96 BOS, 97 EOS. Anything else
    encodes as '?', so the toy model's output is always readable."""

    vocab_size = 98
    bos_token_id, eos_token_id = 96, 97

    def encode(self, text: str) -> list[int]:
        out = []
        for ch in text:
            o = ord(ch)
            out.append(95 if ch == "\n" else (o - 32 if 32 <= o <= 126 else ord("?") - 32))
        return out

    def decode(self, ids) -> str:
        return "".join("\n" if i == 95 else chr(i + 32) for i in ids if 0 <= i <= 95)


class HFTokenizer:
    def __init__(self, model_dir):
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        self._tok = Tokenizer.from_file(str(path)) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            raise ValueError("this model directory has no tokenizer.json; pass token ids "
                             "instead of text, or add the tokenizer to the directory")
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        if self._tok is None:
            return " ".join(str(i) for i in ids)
        return self._tok.decode(list(ids), skip_special_tokens=True)
