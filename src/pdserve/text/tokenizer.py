"""Tokenizers: Hugging Face's `tokenizers` for checkpoints (a directory's
tokenizer.json, or one built from a GGUF file's metadata as transformers
builds it), characters for tiny. Each has encode, decode (special tokens
skipped), bos_token / eos_token and their ids, chat_template (or None) and
vocab_size."""

from __future__ import annotations

import json
from pathlib import Path


class PrintableTokenizer:
    """The tiny preset's tokenizer: one id per printable ASCII character
    (0..94 for ' '..'~'), 95 for a newline, 96 BOS, 97 EOS. Anything else
    encodes as '?', so the toy model's output is always readable."""

    vocab_size = 98
    bos_token_id, eos_token_id = 96, 97
    bos_token = eos_token = None        # no text spells them
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = []
        for ch in text:
            o = ord(ch)
            out.append(95 if ch == "\n" else (o - 32 if 32 <= o <= 126 else ord("?") - 32))
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("\n" if i == 95 else chr(i + 32) for i in ids if 0 <= i <= 95)

    def decode_stream(self, context=(), skip_special_tokens: bool = True):
        return _PrintableStream()          # BOS and EOS have no text either way


class _PrintableStream:
    """One character a token: nothing to hold back."""

    @staticmethod
    def step(token: int) -> str | None:
        return "\n" if token == 95 else (chr(token + 32) if 0 <= token < 95 else None)


NO_TOKENIZER = ("this model directory has no tokenizer.json; pass token ids instead of text, "
                "or add the tokenizer to the directory")


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the special tokens and chat template its
    checkpoint declares. `tok` None (a checkpoint without a tokenizer) still
    decodes, as ids, but refuses text with the reason `missing`."""

    def __init__(self, tok, *, bos_token: str | None = None, eos_token: str | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 chat_template: str | None = None, missing: str = NO_TOKENIZER):
        self._tok = tok
        self._missing = missing
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._id(bos_token)
        self.eos_token_id = eos_token_id if eos_token_id is not None else self._id(eos_token)
        self.chat_template = chat_template
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True) if tok is not None else None

    def _id(self, token: str | None) -> int | None:
        return self._tok.token_to_id(token) if token is not None and self._tok is not None \
            else None

    @classmethod
    def from_directory(cls, model_dir) -> HFTokenizer:
        """tokenizer.json, with the special tokens of tokenizer_config.json (or
        special_tokens_map.json) and the chat template of chat_template.jinja
        or tokenizer_config.json."""
        from tokenizers import Tokenizer

        d = Path(model_dir)
        path = d / "tokenizer.json"
        tok = Tokenizer.from_file(str(path)) if path.is_file() else None
        conf = _read_json(d / "tokenizer_config.json")
        special = {**_read_json(d / "special_tokens_map.json"), **conf}
        template = d / "chat_template.jinja"
        chat = template.read_text() if template.is_file() else conf.get("chat_template")
        if isinstance(chat, list):           # named templates: the default one
            chat = next((t["template"] for t in chat if t.get("name") == "default"), None)
        return cls(tok, bos_token=_content(special.get("bos_token")),
                   eos_token=_content(special.get("eos_token")), chat_template=chat)

    @classmethod
    def from_gguf(cls, meta: dict) -> HFTokenizer:
        """The tokenizer a GGUF file's metadata (`GGUFCheckpoint.metadata`)
        describes. Byte-level BPE (tokenizer.ggml.model gpt2) is built as
        transformers builds it; any other kind refuses text."""
        tokens = meta.get("tokenizer.ggml.tokens") or []
        kind = meta.get("tokenizer.ggml.model")
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
        names = {k: tokens[i] if i is not None and i < len(tokens) else None
                 for k, i in ids.items()}
        if kind == "gpt2" and tokens:
            tok, missing = _byte_level_bpe(meta), ""
        else:
            tok, missing = None, (f"this GGUF's tokenizer ({kind!r}) is not supported; pdserve "
                                  "builds gpt2 (byte-level BPE) GGUF tokenizers; pass token "
                                  "ids instead of text")
        return cls(tok, bos_token=names["bos"], eos_token=names["eos"],
                   bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                   chat_template=meta.get("tokenizer.chat_template"), missing=missing)

    def to_json(self) -> str | None:
        """The tokenizer as tokenizer.json text (None: none): what a grammar
        library builds its view of the vocabulary from."""
        return self._tok.to_str() if self._tok is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `add_special_tokens=False` leaves out the BOS/EOS the
        tokenizer adds itself (for text a chat template already marked)."""
        if self._tok is None:
            raise ValueError(self._missing)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """`skip_special_tokens=False`: special tokens keep their text
        (`<|im_end|>`), as a logprob entry names the token it scores."""
        if self._tok is None:
            return " ".join(str(i) for i in ids)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context=(), skip_special_tokens: bool = True):
        """An incremental decoder (`step(id) -> str | None`): tokenizers'
        DecodeStream, which holds back a character until its bytes are all
        in; `context` (the prompt's last tokens) gives the first output token
        its leading space or merge."""
        if self._tok is None:
            return _JoinedIds()
        from tokenizers.decoders import DecodeStream

        return _BoundStream(DecodeStream(ids=list(context),
                                         skip_special_tokens=skip_special_tokens), self._tok)


class _BoundStream:
    __slots__ = ("step",)

    def __init__(self, stream, tok):
        step = stream.step
        self.step = lambda token: step(tok, token)


class _JoinedIds:
    """No tokenizer: the ids themselves, space-separated (as `decode`)."""

    def __init__(self):
        self.first = True

    def step(self, token: int) -> str:
        out = ("" if self.first else " ") + str(token)
        self.first = False
        return out


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an
    AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


# ---- GGUF byte-level BPE, as transformers' gguf_tokenizer_mapping builds it --

CONTROL, USER_DEFINED = 3, 4            # tokenizer.ggml.token_type values

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split its merges were learned over; the rest
# (gpt2, smollm, ...) use the byte-level pre-tokenizer's own GPT-2 split.
# Only the splits of vocabularies that Llama-architecture files carry.
PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe",
                     "dbrx"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (transformers' bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    spell = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in spell):
        spell[b] = chr(256 + n)
    return spell


def _byte_level_bpe(meta: dict):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or ()
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # a token outside the byte alphabet is stored as text; BPE wants its bytes spelled
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or ()]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    split = PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))  # type: ignore[arg-type]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # control tokens (<|im_start|>, ...) match whole, as special; one spelled
    # outside the byte alphabet is a llama.cpp mislabel and stays ordinary
    named = {tokens[i] for k in ("bos", "eos", "unknown", "padding")
             if (i := meta.get(f"tokenizer.ggml.{k}_token_id")) is not None and i < len(tokens)}
    special = [t for t, ty in zip(tokens, types) if ty == CONTROL] + sorted(named)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in dict.fromkeys(special) if set(t) <= alphabet])
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    bos, eos = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token")) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and eos is not None
    if add_bos or add_eos:
        head = f"{tokens[bos]} " if add_bos else ""
        tail = f" {tokens[eos]}" if add_eos else ""
        tok.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}",
            special_tokens=[(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on])
    return tok
