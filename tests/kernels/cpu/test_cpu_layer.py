"""pdserve's C decoder layer for every row of a round (kernels/cpu/layer.c
and .py): the same layer as DecoderModel's torch path, its K/V in the same
slots, on SmolLM2 and on small random models with what SmolLM2 lacks (q/k/v
biases, a sliding window); a row's bits whatever its round; and where it
does not fit, the reason."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pdserve.kernels.attention import BatchMeta, SeqMeta, TorchAttention
from pdserve.kernels.models.loader import load_model
from pdserve.kernels.models.model import DecoderModel, random_weights
from pdserve.kernels.models.model_config import ModelConfig
from pdserve.kernels.cpu.features import cpu_flags
from pdserve.kernels.cpu.native import KERNELS_ENV, native_kernels
from pdserve.kernels.cpu.quantized import from_blocks

needs_lib = pytest.mark.skipif(native_kernels().lib is None,
                               reason=f"no native kernels: {native_kernels().why}")
PS = 16


def one_by_one(model, tokens: list[int], path: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at every position of `tokens` fed as decode rows, one round
    each (teacher-forced), through the C layer (`path`) or torch's, and the
    cache they leave."""
    keep, model.native_layers = model.native_layers, model.native_layers if path else None
    try:
        table = list(range(-(-len(tokens) // PS)))
        cache = model.new_cache(len(table), PS)
        out = []
        for t, tok in enumerate(tokens):
            meta = BatchMeta([SeqMeta(0, 1, t + 1, table)], torch.tensor([t]),
                             torch.tensor([t]), num_decodes=1,
                             window=model.cfg.sliding_window)
            out.append(model.forward(torch.tensor([tok]), meta, cache, torch.tensor([0]))[0])
        return torch.stack(out), cache.data.float()
    finally:
        model.native_layers = keep


@pytest.fixture(scope="module")
def smollm2():
    model, tok = load_model(None, "smollm2-135m", dtype="float32", quantization="gguf")
    return model, tok


@needs_lib
def test_smollm2s_decode_rows_take_the_c_layer_and_track_torchs_path(smollm2):
    """Teacher-forced over a sentence, decode rows through the C layer give
    torch's path's top token nearly everywhere and close logits (the two
    differ by float32 rounding, which can flip a value's 8-bit rounding
    into the next matmul), and leave the same K/V in the same slots."""
    model, tok = smollm2
    assert model.native_layers is not None, model.native_layers_why
    ids = tok.encode("The river ran through the old town, past the mill and under three "
                     "stone bridges, and in spring the water rose to the arches.")
    got, got_cache = one_by_one(model, ids, path=True)
    want, want_cache = one_by_one(model, ids, path=False)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    assert ((got - want).abs().amax(-1) < 0.1 * want.abs().amax(-1)).all()
    assert (got_cache - want_cache).norm() < 0.03 * want_cache.norm()


def small_model(bias: bool, window: int | None, dtype: torch.dtype, seed: int = 0):
    """A 2-layer Llama (Qwen2's biases, Mistral's window where asked) whose
    projections are Q4_0 blocks and LM head Q8_0."""
    cfg = ModelConfig(arch="mistral" if window else "llama", vocab_size=256, hidden_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      intermediate_size=256, max_position=512, sliding_window=window,
                      attention_bias=bias)
    attn = TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window)
    return DecoderModel(cfg, quantized_weights(cfg, seed), dtype, "cpu", attn)


def quantized_weights(cfg: ModelConfig, seed: int) -> dict:
    """Random weights with every matrix as Q4_0 blocks, the LM head Q8_0."""
    w = random_weights(cfg, seed)
    for name, t in list(w.items()):
        if t.dim() == 2:
            kind = T.Q8_0 if name == "lm_head.weight" else T.Q4_0
            w[name] = from_blocks(quantize(t.numpy().astype(np.float32), kind), kind.name,
                                  *t.shape)
    return w


@needs_lib
@pytest.mark.parametrize("bias,window,dtype", [(True, None, torch.float32),
                                               (False, 24, torch.bfloat16)])
def test_biases_windows_and_bfloat16_pages_as_torchs_path(bias, window, dtype):
    model = small_model(bias, window, dtype)
    assert model.native_layers is not None, model.native_layers_why
    tokens = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    got, got_cache = one_by_one(model, tokens, path=True)
    want, want_cache = one_by_one(model, tokens, path=False)
    tol = 0.05 if dtype == torch.float32 else 0.1        # bfloat16: torch's path rounds more
    assert (got - want).norm() < tol * want.norm()
    assert (got_cache - want_cache).norm() < tol * want_cache.norm()


def chunked(model, tokens: list[int], chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at every position of `tokens` prefilled in rounds of
    `chunks` rows each (a chunk's rows attend each other causally), and
    the cache they leave."""
    table = list(range(-(-len(tokens) // PS)))
    cache = model.new_cache(len(table), PS)
    out, at = [], 0
    for n in chunks:
        rows = torch.arange(at, at + n)
        meta = BatchMeta([SeqMeta(0, n, at + n, table)], rows, rows,
                         window=model.cfg.sliding_window)
        out.append(model.forward(torch.tensor(tokens[at:at + n]), meta, cache,
                                 torch.arange(n)))
        at += n
    return torch.cat(out), cache.data.float()


@needs_lib
@pytest.mark.parametrize("bias,window,dtype", [(True, None, torch.float32),
                                               (False, 24, torch.bfloat16)])
@pytest.mark.invariance
def test_a_prompt_has_the_same_bits_however_it_is_chunked(bias, window, dtype):
    """Every row takes the C layer, each computed on its own: a prompt's
    logits and K/V are the same bits prefilled in one chunk or in uneven
    chunks over several rounds. Its rows multiply at about 15 bits of
    activation precision, decode rows at 8: fed a token a round, the same
    tokens come out close, not equal."""
    model = small_model(bias, window, dtype)
    tokens = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    whole, whole_cache = chunked(model, tokens, [70])
    for chunks in ([5, 33, 32], [1, 16, 53]):
        got, got_cache = chunked(model, tokens, chunks)
        assert torch.equal(got, whole), chunks
        assert torch.equal(got_cache, whole_cache), chunks
    fed, fed_cache = one_by_one(model, tokens, path=True)
    assert not torch.equal(fed, whole)
    assert (fed - whole).norm() < 0.05 * whole.norm()
    assert (fed_cache - whole_cache).norm() < 0.05 * whole_cache.norm()


@needs_lib
def test_a_bad_slot_is_not_written():
    """A decode row whose slot is -1 (a group that keeps no K/V for it)
    writes nothing: the cache is as it was."""
    model = small_model(False, None, torch.float32)
    cache = model.new_cache(2, PS)
    cache.data.normal_(generator=torch.Generator().manual_seed(0))
    before = cache.data.clone()
    meta = BatchMeta([SeqMeta(0, 1, 5, [0])], torch.tensor([-1]), torch.tensor([4]),
                     num_decodes=1)
    model.forward(torch.tensor([7]), meta, cache, torch.tensor([0]))
    assert torch.equal(cache.data, before)


def test_where_the_layer_does_not_fit_it_says_why(monkeypatch):
    dense = small_model(False, None, torch.float32)
    dense_w = random_weights(dense.cfg, 0)
    plain = DecoderModel(dense.cfg, dense_w, torch.float32, "cpu", dense.attention)
    assert plain.native_layers is None
    assert "not every projection is quantized" in plain.native_layers_why
    monkeypatch.setenv(KERNELS_ENV, "torch")
    torch_only = small_model(False, None, torch.float32)
    assert torch_only.native_layers is None
    assert f"{KERNELS_ENV} is torch" in torch_only.native_layers_why


@needs_lib
def test_the_load_says_which_path_the_rows_take(caplog, monkeypatch):
    with caplog.at_level("INFO", logger="pdserve.kernels"):
        load_model(None, "smollm2-135m", dtype="float32", quantization="gguf")
    assert "layers: pdserve's C layers, a prompt's rows in two 8-bit passes" in caplog.text
    assert "prompt rows: two 8-bit passes in pdserve's order (cpu/matmul.c); their logits: " \
        "float32 in pdserve's order (cpu/dense.c)" in caplog.text
    assert ("which pdserve's kernels do not use" in caplog.text) == ("amx_bf16" in cpu_flags())
    caplog.clear()
    monkeypatch.setenv(KERNELS_ENV, "torch")
    with caplog.at_level("INFO", logger="pdserve.kernels"):
        load_model(None, "smollm2-135m", dtype="float32", quantization="gguf")
    assert f"layers: torch's operators, since pdserve's kernels do not run here " \
        f"({KERNELS_ENV} is torch)" in caplog.text
    assert "prompt rows: torch's BLAS (a row's bits may depend on its round); their logits: " \
        "torch's BLAS" in caplog.text


@needs_lib
def test_capture_stays_off_and_a_bad_position_is_refused():
    """A captured step would take torch's path for some rounds; the C layer
    reads its rotary table unchecked, so a position outside it is an error
    before the call."""
    from pdserve.kernels.capture import CaptureMode, choose_capture

    model = small_model(False, None, torch.float32)
    assert choose_capture("on", model) == (CaptureMode.OFF,
                                           "every row runs pdserve's C layers")
    cache = model.new_cache(2, PS)
    for pos in (-1, model.cfg.max_position):
        meta = BatchMeta([SeqMeta(0, 1, 5, [0])], torch.tensor([4]), torch.tensor([pos]),
                         num_decodes=1)
        with pytest.raises(IndexError, match="outside the model's"):
            model.forward(torch.tensor([7]), meta, cache, torch.tensor([0]))


@pytest.mark.invariance
@needs_lib
def test_a_decode_rows_bits_are_the_same_beside_verify_rows_and_with_lora_enabled_it_is_torchs():
    """Verify rows (a speculative round) take the C layer too and leave the
    decode row's bits alone; once LoRA adapters are enabled every row takes
    torch's path, adapter or not, so a base row does not change with what
    shares its round."""
    model = small_model(False, None, torch.float32)
    cache = model.new_cache(8, PS)
    cache.data.normal_(generator=torch.Generator().manual_seed(2))

    def round_(verify: bool):
        seqs, slots, pos, toks = [], [], [], []
        if verify:                      # 3 verify rows at positions 20..22: page 5
            seqs.append(SeqMeta(0, 3, 23, [4, 5]))
            slots += [5 * PS + 4, 5 * PS + 5, 5 * PS + 6]
            pos += [20, 21, 22]
            toks += [9, 10, 11]
        seqs.append(SeqMeta(len(toks), 1, 30, [0, 1]))      # the decode row at 29
        slots.append(1 * PS + 13)
        pos.append(29)
        toks.append(12)
        meta = BatchMeta(seqs, torch.tensor(slots), torch.tensor(pos), num_decodes=1,
                         num_verifies=1 if verify else 0)
        return model.forward(torch.tensor(toks), meta, cache,
                             torch.arange(len(toks)))[-1]

    alone = round_(False)
    assert torch.equal(round_(True), alone)
    model.native_layers, layer = None, model.native_layers
    torch_path = round_(False)
    model.native_layers = layer
    assert not torch.equal(torch_path, alone)     # the two paths round differently
    model.enable_lora(2, 4)
    assert torch.equal(round_(False), torch_path)


@needs_lib
def test_a_prompts_rows_are_nearer_the_files_exact_values_than_decode_rows():
    """The file's weights dequantized in float32 are what both paths
    approximate: a prompt's rows (two 8-bit passes, the logits through the
    head's dense copy) land over ten times nearer them than the same
    tokens fed as decode rows (one pass; about 280x here)."""
    model = small_model(False, None, torch.float32)
    exact_w = {name: (t.dequantize() if hasattr(t, "dequantize") else t)
               for name, t in quantized_weights(model.cfg, 0).items()}
    exact = DecoderModel(model.cfg, exact_w, torch.float32, "cpu", model.attention)
    assert exact.native_layers is None
    tokens = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    want, _ = chunked(exact, tokens, [64])
    prompt, _ = chunked(model, tokens, [64])
    fed, _ = one_by_one(model, tokens, path=True)
    assert (prompt - want).norm() * 10 < (fed - want).norm()



@needs_lib
@pytest.mark.skipif(native_kernels().lib is None or not native_kernels().lib.pd_has_bf16(),
                    reason="this CPU has no AVX512-BF16")
def test_a_bfloat16_models_prompt_rows_take_one_bfloat16_pass():
    """Where the CPU multiplies bfloat16, a bfloat16 model's prompt rows
    multiply its bfloat16 weights once (cpu/bf16.c) instead of taking two
    8-bit passes: other bits, still well nearer the file's exact values than
    decode rows (about 1.9x here), and not far from the two passes (1.4x)."""
    from pdserve.kernels.cpu import layer as cpu_layer

    model = small_model(False, None, torch.bfloat16)
    assert model.native_layers.prompt_bf16
    weights = [w for layer in model.layers for w in (layer[3], layer[5], layer[7], layer[8])]
    assert all(w.dense is None and w.bf16 is not None for w in weights)   # one copy each
    exact_w = {name: (t.dequantize() if hasattr(t, "dequantize") else t)
               for name, t in quantized_weights(model.cfg, 0).items()}
    exact = DecoderModel(model.cfg, exact_w, torch.float32, "cpu", model.attention)
    tokens = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    want, _ = chunked(exact, tokens, [64])
    prompt, _ = chunked(model, tokens, [64])
    fed, _ = one_by_one(model, tokens, path=True)

    lib = model.native_layers.lib

    class NoBf16:                       # the library as a CPU without the instructions sees it
        def __getattr__(self, name):
            return (lambda: 0) if name == "pd_has_bf16" else getattr(lib, name)
    model.native_layers = cpu_layer.NativeLayers(model, NoBf16())
    assert not model.native_layers.prompt_bf16
    two, _ = chunked(model, tokens, [64])
    assert not torch.equal(prompt, two)

    def err(got):
        return (got.float() - want).norm() / want.norm()
    assert err(prompt) < 0.75 * err(fed)
    assert err(prompt) < 2 * err(two)


@needs_lib
def test_verify_rows_compute_as_decode_rows():
    """A speculative round's verify rows take the same one-pass path as
    decode rows: three tokens verified at once give the bits they give fed
    a round each."""
    model = small_model(True, None, torch.float32)
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    fed, _ = one_by_one(model, tokens, path=True)
    table = list(range(-(-len(tokens) // PS)))
    cache = model.new_cache(len(table), PS)
    for t, tok in enumerate(tokens[:37]):          # the history, as decode rows
        meta = BatchMeta([SeqMeta(0, 1, t + 1, table)], torch.tensor([t]), torch.tensor([t]),
                         num_decodes=1)
        model.forward(torch.tensor([tok]), meta, cache, torch.tensor([0]))
    rows = torch.arange(37, 40)
    meta = BatchMeta([SeqMeta(0, 3, 40, table)], rows, rows, num_verifies=1)
    verified = model.forward(torch.tensor(tokens[37:]), meta, cache, torch.arange(3))
    assert torch.equal(verified, fed[37:])
