"""The paged model against Hugging Face transformers on the same weights,
and the offline API's output invariant under every scheduling choice."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.models.model_config import ModelError
from support.checkpoints import hf_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 9, 3, 77, 12, 8, 30, 2, 61, 40, 7],
           [5, 17, 42, 9, 3, 77, 12, 8, 90, 91, 4],
           list(range(1, 40)),
           [94, 3]]


def greedy(n=12):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul-prefill", "sdpa-prefill"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_paged_model_matches_transformers(tmp_path, arch, sdpa):
    model, d = hf_model(tmp_path, arch)
    llm = LLM({"model": {"path": str(d)}, "engine": {"page_size": 4, "total_pages": 128,
                                                      "max_scheduled_tokens": 16}})
    if sdpa:                            # every prefill chunk past the whole-scores budget
        llm.model.attention.MATMUL_SCORES = 0
    # logits of the last prompt token, through chunked paged prefill
    for prompt in PROMPTS[:3]:
        want = model(torch.tensor([prompt])).logits[0, -1]
        from pdserve.kernels.attention import BatchMeta, SeqMeta
        ex = llm.executor
        table = list(range(-(-len(prompt) // 4)))
        meta = BatchMeta([SeqMeta(0, len(prompt), len(prompt), table)],
                         torch.tensor([table[p // 4] * 4 + p % 4 for p in range(len(prompt))]),
                         torch.arange(len(prompt)), window=llm.model.cfg.sliding_window)
        got = llm.model.forward(torch.tensor(prompt), meta, ex.cache,
                                torch.tensor([len(prompt) - 1]))[0]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    # greedy generation, batched with chunking and paging, token for token
    outs = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM().generate(PROMPTS, greedy(20), use_tqdm=False)]


@pytest.mark.parametrize("engine", [
    {"max_scheduled_tokens": 16},                                        # chunk size
    {"max_scheduled_tokens": 4096},
    {"enable_mixed_prefill_decode": False},                              # non-mixed
    {"page_size": 1, "total_pages": 4096},
    {"page_size": 4, "total_pages": 24, "safe_steps": 4},                # retraction
    {"page_size": 4, "total_pages": 24, "safe_steps": 4, "host_pages": 64},
])
def test_greedy_output_is_unchanged_by_scheduling(reference, engine):
    llm = LLM(**engine)
    outs = llm.generate(PROMPTS, greedy(20), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    llm.engine.planner.assert_idle()


def test_retraction_really_happens_in_the_tight_pool_above(reference):
    llm = LLM(page_size=4, total_pages=24, safe_steps=4)
    reqs = llm.generate(PROMPTS, greedy(20), use_tqdm=False)
    assert [o.token_ids for o in reqs] == reference
    # count how often the engine retracted while generating
    llm2 = LLM(page_size=4, total_pages=24, safe_steps=4)
    seen = 0
    orig = llm2.engine.step

    def counting():
        nonlocal seen
        out = orig()
        seen += len(out.plan.retracts) if out else 0
        return out
    llm2.engine.step = counting
    llm2.generate(PROMPTS, greedy(20), use_tqdm=False)
    assert seen > 0


def test_prefix_cache_hits_do_not_change_output(reference):
    llm = LLM(page_size=4)
    first = llm.generate(PROMPTS, greedy(20), use_tqdm=False)
    second = llm.generate(PROMPTS, greedy(20), use_tqdm=False)   # now cached
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == reference


def test_batch_composition_does_not_change_output(reference):
    llm = LLM()
    alone = [llm.generate([p], greedy(20), use_tqdm=False)[0].token_ids for p in PROMPTS]
    assert alone == reference


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=7)
    llm = LLM()
    a = llm.generate(PROMPTS, sp, use_tqdm=False)[1].token_ids
    b = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0].token_ids
    assert a == b


def test_top_k_of_one_is_greedy(reference):
    outs = LLM().generate(PROMPTS, SamplingParams(max_tokens=20, temperature=1.0, top_k=1,
                                                  ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


def test_stop_token_ids_and_stop_strings_end_generation(reference):
    llm = LLM()
    stop_tok = reference[0][5]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0,
                                                    stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_tok
    assert len(out.token_ids) == reference[0].index(stop_tok) + 1
    text = llm.tokenizer.decode(reference[0])
    stop = text[6:8]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0, stop=stop),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert text.startswith(out.text)


def test_text_prompts_round_trip_through_the_tokenizer():
    llm = LLM()
    out = llm.generate("Hello, world", greedy(5), use_tqdm=False)[0]
    assert out.prompt == "Hello, world"
    assert llm.tokenizer.decode(out.prompt_token_ids) == "Hello, world"
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_unknown_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        LLM({"model": {"path": str(tmp_path / "nope")}})


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelError, match="not supported; pdserve runs"):
        LLM({"model": {"path": str(tmp_path)}})


def test_a_prompt_past_the_context_limit_refuses_the_whole_batch():
    llm = LLM(max_context_tokens=64)
    with pytest.raises(ValueError, match="prompt 1: prompt of 100 tokens exceeds"):
        llm.generate([[1, 2, 3], [4] * 100], greedy(4), use_tqdm=False)
    assert not llm.engine.planner.requests          # nothing was half submitted


@pytest.mark.parametrize("kw,words", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_parameters_are_refused(kw, words):
    with pytest.raises(ValueError, match=f"SamplingParams.{words}"):
        SamplingParams(**kw)


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        LLM().generate([[1, 2, 100000]], greedy(2), use_tqdm=False)


# the CUDA checks (flashinfer row by row, the page-locked host cache) are in
# tests/kernels/test_device.py, which collects without ray or transformers


def test_page_copies_move_whole_runs_and_scattered_pages_between_caches():
    from pdserve.kernels.kv_cache import KVCache

    dev = KVCache(2, 12, 4, 2, 8, torch.float32, "cpu")
    dev.data.copy_(torch.randn(dev.data.shape))
    host = KVCache(2, 10, 4, 2, 8, torch.float32, "cpu")
    src, dst = [3, 4, 5, 9, 0, 1], [0, 1, 2, 7, 8, 3]        # a run, a single, a broken run
    host.copy_pages_from(dev, src, dst)
    assert torch.equal(host.data[dst], dev.data[src])
    assert not host.data[[4, 5, 6, 9]].any()                 # untouched pages stay
    back = KVCache(2, 12, 4, 2, 8, torch.float32, "cpu")
    back.copy_pages_from(host, dst, [11, 10, 9, 8, 7, 6])
    assert torch.equal(back.data[[11, 10, 9, 8, 7, 6]], dev.data[src])


def test_a_stop_string_on_the_last_allowed_token_is_still_cut():
    llm = LLM()
    full = llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)[0].text
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0,
                                                    stop=full[-1]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and full[-1] not in out.text


def _with_dtype(d, dtype: str):
    import json

    raw = json.loads((d / "config.json").read_text())
    raw.pop("torch_dtype", None)
    raw["dtype"] = dtype
    (d / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("own,want", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                      ("float16", torch.bfloat16)])      # fp16 is slow on CPU
def test_dtype_auto_follows_the_checkpoint(tmp_path, own, want):
    _, d = hf_model(tmp_path, "llama")
    _with_dtype(d, own)
    assert LLM({"model": {"path": str(d)}}).model.dtype == want
    assert LLM({"model": {"path": str(d), "dtype": "float32"}}).model.dtype == torch.float32
    assert LLM().model.dtype == torch.float32                   # the tiny preset


def test_bfloat16_logits_track_float32(tmp_path):
    model, d = hf_model(tmp_path, "llama")
    prompt = PROMPTS[2]
    want = model(torch.tensor([prompt])).logits[0]
    llm = LLM({"model": {"path": str(d), "dtype": "bfloat16"},
               "engine": {"page_size": 4, "total_pages": 128, "max_scheduled_tokens": 16}})
    assert llm.model.dtype == torch.bfloat16
    outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert all(len(o.token_ids) == 6 for o in outs)
    # the prompt's logits through the bfloat16 paged path: close to float32's
    from pdserve.kernels.attention import BatchMeta, SeqMeta
    table = list(range(-(-len(prompt) // 4)))
    meta = BatchMeta([SeqMeta(0, len(prompt), len(prompt), table)],
                     torch.tensor([table[p // 4] * 4 + p % 4 for p in range(len(prompt))]),
                     torch.arange(len(prompt)))
    got = llm.model.forward(torch.tensor(prompt), meta, llm.executor.cache,
                            torch.arange(len(prompt)))
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("model,words", [
    ({"dtype": "fp8"}, "model.dtype is 'fp8'; use one of auto"),
    ({"attention": "xformers"}, "model.attention is 'xformers'; use one of auto"),
])
def test_bad_model_dtype_or_attention_is_a_clear_error(model, words):
    from pdserve.scheduler.config import ConfigError
    with pytest.raises(ConfigError, match=words):
        LLM({"model": model})


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import sys

    from support import flashinfer_fake

    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_fake)
    return flashinfer_fake


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_flashinfer_backend_hands_flashinfer_the_right_plans(tmp_path, arch, fake_flashinfer,
                                                             monkeypatch):
    """On CPU, against a stand-in written from flashinfer's documented
    contract (tests/support/flashinfer_fake.py): the CSR page tables, the prefill and
    decode row split, the strided per-layer caches and the sliding window
    pdserve passes must give the torch reference's tokens exactly. float32
    for exactness (the stand-in is told to allow it; real flashinfer has no
    float32 kernels, which the test below checks pdserve knows). The real
    kernels are the device test's."""
    from pdserve.kernels.flashinfer_attention import FlashInferAttention

    monkeypatch.setattr(fake_flashinfer, "DTYPES", [torch.float32])
    _, d = hf_model(tmp_path, arch)
    conf = {"model": {"path": str(d)},
            "engine": {"page_size": 4, "total_pages": 128, "max_scheduled_tokens": 16}}
    want = [o.token_ids for o in LLM(conf).generate(PROMPTS, greedy(10), use_tqdm=False)]
    llm = LLM(conf)
    c = llm.model.cfg
    att = llm.model.attention = FlashInferAttention(c.num_heads, c.num_kv_heads, c.head_dim,
                                                    c.sliding_window)
    rounds = 0
    step = llm.engine.step

    def counted():
        nonlocal rounds
        rounds += 1
        return step()

    llm.engine.step = counted
    for _ in range(2):                  # the second pass reads cached prefix pages
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy(10), use_tqdm=False)]
        assert got == want
    (group,) = att._groups.values()     # one cache group: full history, or Mistral's window
    assert 0 < group.prefill.plans <= rounds and 0 < group.decode.plans <= rounds


def test_attention_auto_and_flashinfer_respect_what_flashinfer_has(fake_flashinfer):
    from pdserve.kernels.backends import make_backend

    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64)
    assert make_backend("auto", "cuda", torch.bfloat16, **kw).name == "flashinfer"
    assert make_backend("auto", "cpu", torch.bfloat16, **kw).name == "torch"
    assert make_backend("auto", "cuda", torch.float32, **kw).name == "torch"
    assert make_backend("auto", "cuda", torch.bfloat16, **{**kw, "head_dim": 16}).name == "torch"
    with pytest.raises(ValueError, match="no float32 kernels; set model.dtype to bfloat16"):
        make_backend("flashinfer", "cuda", torch.float32, **kw)
    with pytest.raises(ValueError, match="no kernels for head_dim 16"):
        make_backend("flashinfer", "cuda", torch.float16, **{**kw, "head_dim": 16})


def test_flashinfer_off_cuda_says_so(fake_flashinfer):
    with pytest.raises(ValueError, match="flashinfer runs on CUDA only, and this model is on cpu"):
        LLM({"model": {"preset": "tiny", "dtype": "bfloat16", "attention": "flashinfer"}})


@pytest.mark.parametrize("device,words", [
    ("gpu", "unknown device 'gpu'; use cpu, cuda or cuda:N"),
    ("mps", "device 'mps' is not supported"),
    pytest.param("cuda", "no CUDA GPU is usable here", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has a GPU: the device is fine")),
])
def test_a_device_that_cannot_be_used_is_a_clear_error(device, words):
    with pytest.raises(ModelError, match=words):
        LLM(device=device)


def test_bench_and_generate_flags_are_checked(capsys):
    from pdserve.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "llm", "--scale", "0"])
    assert "'0' is not a positive integer" in capsys.readouterr().err
    assert main(["generate", "--address", "127.0.0.1:1", "--dtype", "bfloat16", "hi"]) == 2
    assert "--dtype and --device apply offline" in capsys.readouterr().err


def test_flashinfer_without_the_gpu_extra_is_a_clear_error(monkeypatch):
    import sys

    from pdserve.kernels.backends import make_backend

    monkeypatch.setitem(sys.modules, "flashinfer", None)       # import fails
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64)
    assert make_backend("auto", "cuda", torch.bfloat16, **kw).name == "torch"
    with pytest.raises(ValueError, match=r"needs the gpu extra: pip install 'pdserve\[gpu\]'"):
        make_backend("flashinfer", "cuda", torch.bfloat16, **kw)


def test_offline_generate_cli_takes_a_dtype(tmp_path, capsys):
    from pdserve.cli.main import main

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("model: {preset: tiny}\n")
    assert main(["generate", "--config", str(cfg), "--dtype", "bfloat16", "--max-tokens", "6",
                 "Hello"]) == 0
    want = LLM(dtype="bfloat16").generate("Hello", SamplingParams(max_tokens=6, temperature=0),
                                          use_tqdm=False)[0].text
    assert capsys.readouterr().out == want + "\n"
