"""Incremental detokenization (kernels/detokenize.py): the streamed pieces
add up to the text of the whole output, characters split across tokens are
held until complete, and stop strings cut the text at their first
occurrence without a stream ever showing part of one."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.text.detokenize import Detokenizer
from pdserve.kernels.models.loader import load_tokenizer
from pdserve.text.tokenizer import PrintableTokenizer

TEXTS = ["Paris is the capital of France.", "naïve café, 日本語のテキスト, emoji 🙂🚀 ok",
         "  leading spaces\n\nnew lines\ttabs", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"]


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer(None, "smollm2-135m")


def stream(tok, ids, stop=(), context=()):
    d = Detokenizer(tok, context, stop)
    pieces = []
    for t in ids:
        hit = d.push(t)
        pieces.append(d.ready())
        if hit:
            break
    pieces.append(d.ready(final=True))
    return d, pieces


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_whole_decode_and_no_piece_splits_a_character(smol, text):
    ids = smol.encode(text, add_special_tokens=False)
    d, pieces = stream(smol, ids)
    assert "".join(pieces) == smol.decode(ids) == d.text
    assert all("\ufffd" not in p for p in pieces)
    # a multi-byte character spread over tokens shows up once, whole
    if any(ord(c) > 0xFFFF for c in text):
        assert any(p == "" for p in pieces[:-1])


def test_prompt_context_gives_the_first_token_its_text(smol):
    prompt = smol.encode("The capital of France is", add_special_tokens=False)
    out = smol.encode(" Paris.", add_special_tokens=False)
    _, pieces = stream(smol, out, context=prompt)
    assert "".join(pieces) == smol.decode(prompt + out)[len(smol.decode(prompt)):]


@pytest.mark.parametrize("text", TEXTS)
def test_a_stop_string_cuts_the_text_and_no_piece_shows_part_of_it(smol, text):
    ids = smol.encode(text, add_special_tokens=False)
    full = smol.decode(ids)
    for stop in {full[5:9], full[-3:], full[10:11]}:
        d, pieces = stream(smol, ids, stop=(stop, "zzz-never"))
        want = full[:full.find(stop)]
        assert d.stopped and "".join(pieces) == want == d.text, stop
        streamed = ""
        for p in pieces:
            streamed += p
            assert want.startswith(streamed)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc \n", max_size=40),
       stops=st.lists(st.text(alphabet="abc \n", min_size=1, max_size=4), min_size=1, max_size=3),
       min_tokens=st.integers(0, 5), include=st.booleans())
def test_random_texts_and_stops_match_the_reference_cut(text, stops, min_tokens, include):
    tok = PrintableTokenizer()
    d = Detokenizer(tok, (), stops, include_stop=include)
    pieces, n = [], 0
    for t in tok.encode(text):
        n += 1
        hit = d.push(t, check_stop=n >= min_tokens)
        pieces.append(d.ready())
        if hit:
            break
    pieces.append(d.ready(final=True))
    got = "".join(pieces)
    assert got == reference_cut(text, stops, include, min_tokens)
    streamed = ""
    for p in pieces:
        streamed += p
        assert got.startswith(streamed)       # nothing shown is ever taken back


def reference_cut(text: str, stops, include: bool = False, min_tokens: int = 0) -> str:
    """Generation stops at the first token, from the min_tokens-th on, at
    which some stop string ends (one char a token here; one that ended
    earlier was not looked for and does not count, as in vLLM); the text
    ends where the leftmost of those begins (with `include`: where it ends,
    the longest if several begin there)."""
    for i in range(max(min_tokens, 1), len(text) + 1):
        hits = [(i - len(s), len(s)) for s in stops if text[:i].endswith(s)]
        if hits:
            at = min(a for a, _ in hits)
            return text[:at + max(n for a, n in hits if a == at)] if include else text[:at]
    return text


def test_the_stop_string_can_end_the_text_and_special_tokens_can_show(smol):
    ids = smol.encode("The capital of France is Paris. It is", add_special_tokens=False)
    d, pieces = stream(smol, ids, stop=("Paris",))
    assert d.text == "The capital of France is "
    d = Detokenizer(smol, (), ("Paris",), include_stop=True)
    pieces = [d.ready() for t in ids if not d.push(t)] + [d.ready(final=True)]
    assert "".join(pieces) == d.text == "The capital of France is Paris"
    marked = smol.encode("<|im_start|>user", add_special_tokens=False)
    assert smol.decode(marked) == "user"               # special tokens skipped by default
    shown = Detokenizer(smol, (), skip_special=False)
    for t in marked:
        shown.push(t)
    assert shown.text == "<|im_start|>user"


def test_a_resubmitted_request_gets_the_text_one_engine_would_have_sent(smol):
    """An engine streams some tokens and dies; the router resubmits the
    prompt plus those tokens, saying how many characters of their text the
    client has. The second engine's output thread goes on where the
    client's text ends: text the first engine held back (the start of a
    possible stop string, half of a character) comes, once. At every cut
    the client's text equals one engine's (it lost the held text, or
    repeated some)."""
    printable = PrintableTokenizer()
    cases = [(printable, printable.encode("Q: "), printable.encode("Hello world. Bye."),
              ("world!",)),                                           # 'wo' held back
             (smol, smol.encode("Price:", add_special_tokens=False),
              smol.encode(" 5€ and 日本語 ok", add_special_tokens=False), ())]   # half of 日
    for tok, prompt, ids, stop in cases:
        whole = _engine_text(tok, prompt, ids, stop, final=True)
        assert whole == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
        for cut in range(1, len(ids)):
            first = _engine_text(tok, prompt, ids[:cut], stop)
            second = _engine_text(tok, prompt + ids[:cut], ids[cut:], stop,
                                  prior=(cut, len(first)), final=True)
            assert first + second == whole, (cut, first, second)


def _engine_text(tok, prompt, tokens, stop, prior=(0, 0), final=False) -> str:
    """The text an engine's output thread sends for request r: opened as
    an engine opens it (`prior`: a resubmission's tokens and characters
    out already), then `tokens` one round each (the last one final)."""
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.engine.outputs import OutputItem, Outputs

    out = Outputs(tok, lambda rid, key: None)
    q = out.subscribe("s")
    try:
        out.open("r", "s", prompt, SamplingParams(stop=stop), prior=prior)
        text = ""
        for i, t in enumerate(tokens):
            last = final and i == len(tokens) - 1
            out.post([OutputItem("r", [t], [], "length" if last else None)])
            text += "".join(ev.text for ev in q.get(timeout=10))
        return text
    finally:
        out.close()
