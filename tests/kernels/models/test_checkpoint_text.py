"""Text in, text out through a Hugging Face checkpoint directory's own
tokenizer.json: a byte-level BPE built with `tokenizers` beside a small
random Llama saved by transformers, served by pdserve.LLM and compared with
transformers' tokenizer and generate on the same directory."""

import json

import pytest
import torch

from pdserve import LLM, SamplingParams
from support.checkpoints import CORPUS, build_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPTS = ["The quick brown fox", "Pages and leases", "A decode engine recovers"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe-llama")
    tok = build_tokenizer()
    save_tokenizer(tok, d)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"))
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(d, safe_serialization=True)
    return model, d


def test_the_directory_tokenizer_encodes_as_transformers_does(checkpoint):
    _, d = checkpoint
    hf = transformers.AutoTokenizer.from_pretrained(d)
    llm = LLM({"model": {"path": str(d)}})
    for text in PROMPTS + ["unseen words: zebra quiz!"]:
        assert llm.tokenizer.encode(text) == hf(text)["input_ids"], text
        assert llm.tokenizer.encode(text)[0] == hf.bos_token_id       # the post-processor ran
    assert (llm.tokenizer.bos_token, llm.tokenizer.eos_token) == ("<s>", "</s>")


def test_text_prompts_generate_the_tokens_and_text_of_transformers(checkpoint):
    model, d = checkpoint
    hf = transformers.AutoTokenizer.from_pretrained(d)
    llm = LLM({"model": {"path": str(d)}, "engine": {"page_size": 4, "total_pages": 128,
                                                      "max_scheduled_tokens": 8}})
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for text, out in zip(PROMPTS, outs):
        enc = hf(text, return_tensors="pt")      # with its attention mask: BOS is id 0
        ref = model.generate(**enc, max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, enc["input_ids"].shape[1]:].tolist()
        assert out.token_ids == ref, text
        assert out.text == hf.decode(ref, skip_special_tokens=True), text
        assert out.text                                               # not empty by accident
