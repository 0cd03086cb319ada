"""flashinfer's MLA decode (kernels/models/moe/mla.py, `FlashInferMlaDecode`)
against the torch reference's absorbed decode. On CPU, through a stand-in
written from flashinfer 0.7.4's documented contract
(tests/support/flashinfer_fake.py) and forced in by handing a DeepSeek-V3
model's MlaAttention the kernel (the test-only seam: `choose_mla_decode`
picks flashinfer on CUDA only): the logits and greedy tokens of torch's
path, decode rows only, one plan a round; CPU and unfit shapes keep torch
and say why. On a GPU (`-m device`), flashinfer's kernels at DeepSeek-V3's
latent widths in bfloat16, against torch's decode on the same pages."""

import json
import random
import sys

import pytest
import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.models.loader import build_model, load_model
from pdserve.kernels.models.model_config import read_config
from pdserve.kernels.models.moe.deepseek_v3 import deepseek_v3_weight_names
from pdserve.kernels.models.moe.mla import FlashInferMlaDecode, choose_mla_decode

PROMPTS = [[(7 * i + 3) % 120 + 1 for i in range(23)], [5, 9, 11, 60]]
STEPS = 8
TOL = 1e-5
# the widths flashinfer's fa2 MLA kernels take (latent a multiple of 128,
# rotary key of 64), which the stand-in holds pdserve to
WIDTHS = dict(kv_lora_rank=128, qk_rope_head_dim=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.moe import deepseek_v3_checkpoint

    return deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3_fi"), **WIDTHS)[1]


@pytest.fixture
def fake(monkeypatch):
    from support import flashinfer_fake

    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_fake)
    # float32 for a tight comparison: the stand-in is told to allow it (the
    # real kernels are half precision; choose_mla_decode keeps torch there)
    monkeypatch.setattr(flashinfer_fake, "DTYPES", [torch.float32])
    return flashinfer_fake


def ours(d, **kw):
    return load_model(str(d), preset=None, dtype="float32", attention="torch", **kw)[0]


def force_flashinfer(model, fake) -> FlashInferMlaDecode:
    """The test-only seam: the model's decode rows through flashinfer's
    kernel (here the stand-in), on CPU and in float32."""
    kernel = FlashInferMlaDecode(fake, model.cfg.mla, model.cfg.num_heads)
    model.mla.decode = kernel
    return kernel


def test_decode_rounds_give_torch_s_logits_and_greedy_tokens(checkpoint, fake):
    """Two sequences prefilled in one round (torch's), then eight decode
    rounds through flashinfer: every round's logits within float32
    rounding of torch's absorbed decode, the same greedy tokens; one plan
    a decode round, reused by the three layers, none for the prefill."""
    from support.tp import PS, greedy

    want_logits, want = greedy(ours(checkpoint), PROMPTS, STEPS)
    model = ours(checkpoint)
    kernel = force_flashinfer(model, fake)
    got_logits, got = greedy(model, PROMPTS, STEPS)
    assert got == want
    for g, w in zip(got_logits, want_logits):
        assert (g - w).abs().max() < TOL
    assert kernel.plans == STEPS
    (wrapper,) = kernel.wrappers()
    m = wrapper.planned[-1]
    lens = [len(p) + STEPS for p in PROMPTS]
    assert m.qo_indptr.tolist() == [0, 1, 2]                 # one query row a sequence
    assert m.kv_len_arr.tolist() == lens
    assert (m.kv_indptr[1:] - m.kv_indptr[:-1]).tolist() == [-(-n // PS) for n in lens]


def test_mixed_rounds_through_the_engine_send_only_decode_rows(checkpoint, fake):
    """Chunks of 8 tokens over pages of 4: the short prompt decodes while
    the long one is still prefilled, so rounds mix chunks and decode rows;
    flashinfer gets the decode rows only, and the engine's tokens are
    torch's, cold and with a prefix hit."""
    from pdserve import LLM, SamplingParams

    conf = dict(dtype="float32", attention="torch", page_size=4, total_pages=64,
                max_scheduled_tokens=8)
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:16] + [3, 1, 4]]

    def run(llm):
        first = [o.token_ids for o in llm.generate(prompts[:2], sp, use_tqdm=False)]
        (hit,) = llm.generate([prompts[2]], sp, use_tqdm=False)
        assert hit.cached_tokens == 16
        llm.engine.planner.assert_idle()
        return first + [hit.token_ids]

    want = run(LLM({"model": {"path": str(checkpoint)}}, **conf))
    llm = LLM({"model": {"path": str(checkpoint)}}, **conf)
    kernel = force_flashinfer(llm.model, fake)
    mixed = []
    run_decode = kernel.run

    def spy(q_lat, q_pe, pages, meta):
        mixed.append(len(meta.seqs) > meta.num_decodes)
        return run_decode(q_lat, q_pe, pages, meta)

    kernel.run = spy
    assert run(llm) == want
    assert any(mixed) and kernel.plans > 0
    (wrapper,) = kernel.wrappers()
    for m in wrapper.planned:
        assert bool((m.qo_indptr[1:] - m.qo_indptr[:-1] == 1).all())


def test_without_the_kernel_or_with_absorb_off_decode_stays_torch_s(checkpoint, fake):
    """A model built on CPU has no flashinfer kernel, and says why; a
    kernel handed in is not used when absorption is off (the reference)."""
    from support.tp import greedy

    model = ours(checkpoint)
    assert model.mla.decode is None
    assert "flashinfer's MLA kernels run on CUDA only" in model.mla_decode_why
    kernel = force_flashinfer(model, fake)
    model.mla.absorb = False
    greedy(model, PROMPTS, 2)
    assert kernel.plans == 0


def test_unfit_dtypes_shapes_and_a_missing_flashinfer_keep_torch_and_say_why(checkpoint,
                                                                             monkeypatch):
    from support import flashinfer_fake

    spec = read_config(checkpoint).mla
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_fake)
    kernel, why = choose_mla_decode(spec, 4, torch.float32, "cuda")
    assert kernel is None and "no float32 MLA kernels (set model.dtype to bfloat16" in why
    narrow = type(spec)(**{**spec.__dict__, "kv_lora_rank": 32, "qk_rope_head_dim": 8})
    kernel, why = choose_mla_decode(narrow, 4, torch.bfloat16, "cuda")
    assert kernel is None and "kv_lora_rank a multiple of 128 and qk_rope_head_dim a " \
                              "multiple of 64; this model's are 32 and 8" in why
    monkeypatch.setitem(sys.modules, "flashinfer", None)       # import fails
    kernel, why = choose_mla_decode(spec, 4, torch.bfloat16, "cuda")
    assert kernel is None and "flashinfer is not installed" in why


# ---- on a GPU -----------------------------------------------------------------------

# DeepSeek-V3's latent attention widths (kv_lora_rank 512, rotary key 64,
# nope and v 128) with four heads and two dense layers, random weights
REAL_MLA = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                vocab_size=512, hidden_size=1024, intermediate_size=1024,
                moe_intermediate_size=256, num_hidden_layers=2, first_k_dense_replace=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_group=1,
                topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                routed_scaling_factor=2.5, q_lora_rank=384, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_scaling=dict(type="yarn", factor=40.0, rope_theta=10000.0,
                                  original_max_position_embeddings=4096, mscale=1.0,
                                  mscale_all_dim=1.0, beta_fast=32, beta_slow=1))


def random_deepseek(cfg, dtype, device) -> dict:
    """Weights for every name the model reads, each normal with a
    1/sqrt(fan-in) scale (norms near one), from a fixed seed."""
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    shapes = {"embed_tokens": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h),
              "q_a_proj": (m.q_lora_rank, h), "q_b_proj": (heads * m.qk_head_dim, m.q_lora_rank),
              "kv_a_proj_with_mqa": (m.cache_width, h),
              "kv_b_proj": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
              "o_proj": (h, heads * m.v_head_dim), "gate_proj": (cfg.intermediate_size, h),
              "up_proj": (cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
              "q_a_layernorm": (m.q_lora_rank,), "kv_a_layernorm": (m.kv_lora_rank,)}
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in deepseek_v3_weight_names(cfg):
        shape = shapes.get(name.split(".")[-2], (h,))
        if len(shape) == 1:
            w = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            w = torch.randn(shape, generator=g) * shape[-1] ** -0.5
        out[name] = w.to(dtype=dtype, device=device)
    return out


def decode_twice(model, cache, device, lens, steps, ps=16):
    """Sequences of `lens` random tokens over scattered pages of `ps`,
    prefilled in one round, then `steps` decode rounds, each run twice on
    the same pages: through the model's flashinfer kernel, then torch's
    (whose entries the cache keeps, and whose greedy tokens feed the next
    round). Yields each round's (flashinfer's logits, torch's), float32."""
    rng = random.Random(0)
    per = -(-(max(lens) + steps) // ps)
    pool = list(range(len(lens) * per))
    rng.shuffle(pool)
    tables = [pool[i * per:(i + 1) * per] for i in range(len(lens))]
    seqs = [[rng.randrange(model.cfg.vocab_size) for _ in range(n)] for n in lens]

    def forward(rows):                      # (sequence, first position, count)
        ids, pos, slot, metas = [], [], [], []
        for s, begin, n in rows:
            metas.append(SeqMeta(len(ids), n, begin + n, tables[s]))
            ids += seqs[s][begin:begin + n]
            pos += range(begin, begin + n)
            slot += [tables[s][p // ps] * ps + p % ps for p in range(begin, begin + n)]
        meta = BatchMeta(metas, torch.tensor(slot, device=device),
                         torch.tensor(pos, device=device),
                         num_decodes=sum(n == 1 for _, _, n in rows))
        last = torch.tensor([n for _, _, n in rows]).cumsum(0) - 1
        return model.forward(torch.tensor(ids, device=device), meta, cache,
                             last.to(device)).float()

    kernel = model.mla.decode
    logits = forward([(i, 0, n) for i, n in enumerate(lens)])     # torch's either way
    for _ in range(steps):
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t)
        rows = [(i, len(s) - 1, 1) for i, s in enumerate(seqs)]
        got = forward(rows)
        model.mla.decode = None
        try:
            logits = forward(rows)
        finally:
            model.mla.decode = kernel
        yield got, logits


@pytest.mark.device
def test_flashinfer_s_mla_decode_on_a_gpu_tracks_torch_s(tmp_path):
    """bfloat16 on CUDA, DeepSeek-V3's latent widths: `choose_mla_decode`
    takes flashinfer; six sequences of 5 to 300 tokens over scattered
    pages of 16 (the layer's cache a strided view spanning both layers)
    decode eight rounds, each through flashinfer's kernel and torch's on
    the same pages: logits within bfloat16's rounding, and the same greedy
    token wherever torch's top two logits are further apart than that
    difference; one plan a round for the two layers. Prints the diffs."""
    (tmp_path / "config.json").write_text(json.dumps(REAL_MLA))
    cfg = read_config(tmp_path)
    model = build_model(cfg, random_deepseek(cfg, torch.bfloat16, "cuda"), torch.bfloat16,
                        "cuda", None)
    kernel = model.mla.decode
    assert kernel is not None, model.mla_decode_why
    assert "flashinfer's fa2 MLA kernel" in model.mla_decode_why
    lens, steps = [5, 17, 64, 130, 255, 300], 8
    (cache,) = model.new_caches([len(lens) * 20], 16)
    report = []
    for step, (got, want) in enumerate(decode_twice(model, cache, "cuda", lens, steps)):
        diff = (got - want).abs().max().item()
        assert diff <= 0.02 * want.abs().max().item() + 1e-2, (step, diff)
        top = want.topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 2 * diff
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), step
        report.append(f"round {step}: max |logit diff| {diff:.1e}, "
                      f"{int(clear.sum())}/{len(lens)} tokens clear")
    assert kernel.plans == steps
    print("\n".join(report))
