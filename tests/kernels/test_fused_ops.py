"""The Llama-family forward's fused elementwise ops (kernels/fused_ops.py):
flashinfer's fused residual add + RMS norm and SiLU-and-mul run only on
CUDA in half precision where flashinfer is installed, and running them
moves a bfloat16 model's logits only within rounding and leaves its greedy
tokens alone, through a prefill round and decode rounds.

On CPU the fused path runs against flashinfer's stand-in
(tests/support/flashinfer_fake.py, written from flashinfer's documented
contract), set on the model by hand: the stand-in's ops are what reach
the forward, never a default. `device` tests run flashinfer's own kernels
(`pytest -m device tests/kernels/test_fused_ops.py`); they print the
eager step's time with each."""

import sys

import pytest
import torch

from pdserve.benchmarks.common.shapes import model_config
from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.fused_ops import TORCH_OPS, FlashInferOps, choose_fused_ops
from pdserve.kernels.lora.batched import LoraRound
from pdserve.kernels.models.loader import attention_shape, build_model, load_backend, load_model
from pdserve.kernels.models.model import random_weights

PS = 4
PAGES = 16                  # per sequence
PROMPTS = [[5, 17, 33, 2, 9, 41, 8, 70, 12, 3, 88], [60, 3, 3, 27], [90, 1, 44]]
STEPS = 8


def model_of(shape: str, dtype: torch.dtype, device, attention: str = "torch"):
    """A Llama of `shape` (benchmarks/common/shapes.py) with seeded random
    weights, its norms' weights drawn around 1 (all ones would hide a
    weight applied to the wrong norm)."""
    cfg = model_config(shape)
    weights = random_weights(cfg, 0, dtype, device)
    g = torch.Generator(device=device).manual_seed(1)
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            w.normal_(1.0, 0.3, generator=g)
    backend = load_backend(attention, device, dtype, attention_shape(cfg))
    return build_model(cfg, weights, dtype, device, backend)


def rounds(model, prompts, steps=STEPS, forced=None, adapters=None):
    """(each round's logits, float32 [sequences, vocab]; the tokens fed
    after the prompts): one prefill round of `prompts` on fresh pages,
    then `steps` decode rounds, each feeding every sequence its greedy
    token, or `forced[s][k]` (teacher forced). `adapters`: each prompt's
    LoRA slot (-1: the base model)."""
    dev = model.device
    cache = model.new_cache(PAGES * len(prompts), PS)
    tables = [list(range(i * PAGES, (i + 1) * PAGES)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]

    def run(spans, decodes):            # (sequence, first position, rows)
        ids, pos, slots, metas, last, row_slots = [], [], [], [], [], []
        for s, begin, n in spans:
            metas.append(SeqMeta(len(ids), n, begin + n, tables[s]))
            ids += seqs[s][begin:begin + n]
            pos += range(begin, begin + n)
            slots += [tables[s][p // PS] * PS + p % PS for p in range(begin, begin + n)]
            last.append(len(ids) - 1)
            row_slots += [adapters[s] if adapters else -1] * n
        meta = BatchMeta(metas, torch.tensor(slots, device=dev), torch.tensor(pos, device=dev),
                         num_decodes=decodes)
        lora = LoraRound.of(model.lora, row_slots) if adapters else None
        return model.forward(torch.tensor(ids, device=dev), meta, cache,
                             torch.tensor(last, device=dev), lora=lora)

    out = [run([(s, 0, len(p)) for s, p in enumerate(prompts)], 0)]
    for k in range(steps):
        greedy = out[-1].argmax(-1).tolist()
        for s in range(len(seqs)):
            seqs[s].append(forced[s][k] if forced else greedy[s])
        out.append(run([(s, len(seq) - 1, 1) for s, seq in enumerate(seqs)], len(seqs)))
    return out, [seq[len(p):] for seq, p in zip(seqs, prompts)]


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The stand-in as `flashinfer`, its fused ops counted per name."""
    from support import flashinfer_fake

    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_fake)
    calls = {}
    for space in (flashinfer_fake.norm, flashinfer_fake.activation):
        for name, fn in vars(space).copy().items():
            def counted(*a, _fn=fn, _name=name, **kw):
                calls[_name] = calls.get(_name, 0) + 1
                return _fn(*a, **kw)
            monkeypatch.setattr(space, name, counted)
    monkeypatch.setattr(flashinfer_fake, "calls", calls, raising=False)
    return flashinfer_fake


def tracks(got: list, want: list) -> int:
    """Assert that each round's logits `got` (the fused ops') are within
    rounding of `want` (torch's) and give the same greedy token wherever
    want's top two logits are further apart than twice the largest
    difference (neither can then pass the other); the rows that were.
    Rounding: each fused op rounds once where torch's round after each
    step, in every layer; a few hundredths of the largest logit."""
    clear_rows = 0
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, k
        diff = (g - w).abs().max().item()
        assert diff <= 0.05 * w.abs().max().item(), (k, diff)
        top = w.topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 2 * diff
        assert torch.equal(g.argmax(-1)[clear], w.argmax(-1)[clear]), k
        clear_rows += int(clear.sum())
    return clear_rows


# ---- where each runs -------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_off_cuda_a_model_runs_torch_s_ops_even_where_flashinfer_imports(fake_flashinfer,
                                                                         dtype):
    model, _ = load_model(None, "tiny", dtype=dtype, attention="torch")
    assert model.fused_ops is TORCH_OPS and model.fused_ops_why == "torch's on cpu"
    model.forward(torch.tensor([5, 6]), BatchMeta([SeqMeta(0, 2, 2, [0])], torch.tensor([0, 1]),
                                                  torch.arange(2)),
                  model.new_cache(2, PS), torch.tensor([1]))
    assert fake_flashinfer.calls == {}


def test_on_cuda_flashinfer_s_ops_need_half_precision_and_flashinfer(monkeypatch):
    cfg = model_config("tiny")
    ops, why = choose_fused_ops(cfg, torch.float32, "cuda")
    assert ops is TORCH_OPS and why == ("torch's: flashinfer's fused norm and SwiGLU have no "
                                        "float32 kernels")
    monkeypatch.setitem(sys.modules, "flashinfer", None)        # import fails
    ops, why = choose_fused_ops(cfg, torch.bfloat16, "cuda")
    assert ops is TORCH_OPS and "flashinfer is not installed (pip install 'pdserve[gpu]')" in why


def test_a_fused_op_that_fails_at_load_leaves_torch_s_and_says_why(fake_flashinfer,
                                                                   monkeypatch):
    def refused(self, cfg, dtype, device):
        raise ValueError("The pointers must be multiple of 16 bytes.")

    monkeypatch.setattr(FlashInferOps, "warm_up", refused)
    ops, why = choose_fused_ops(model_config("tiny"), torch.bfloat16, "cuda")
    assert ops is TORCH_OPS
    assert why == ("torch's: flashinfer's fused ops failed at load: ValueError: The pointers "
                   "must be multiple of 16 bytes.")


def test_the_warm_up_runs_each_fused_op_once_on_the_model_s_widths(fake_flashinfer):
    FlashInferOps(fake_flashinfer).warm_up(model_config("tiny"), torch.bfloat16, "cpu")
    assert fake_flashinfer.calls == {"rmsnorm": 1, "fused_add_rmsnorm": 1, "silu_and_mul": 1}


# ---- what the fused path computes (CPU, the stand-in) ----------------------------

def test_each_round_runs_one_norm_then_a_fused_add_and_norm_per_residual_add(
        fake_flashinfer):
    """A round's ops: the first layer's norm alone, each residual add fused
    with the norm after it (the last layer's MLP add before the final norm,
    which runs on the logits rows alone), one SiLU-and-mul a layer. Teacher
    forced on torch's greedy tokens through a prefill round and decode
    rounds, the logits track torch's, and are not its bits (the stand-in's
    ops really ran)."""
    model = model_of("tiny", torch.bfloat16, "cpu")
    assert model.fused_ops is TORCH_OPS
    want, want_tokens = rounds(model, PROMPTS)
    model.fused_ops = FlashInferOps(fake_flashinfer)
    got, _ = rounds(model, PROMPTS, forced=want_tokens)
    layers, n = model.cfg.num_layers, STEPS + 1
    assert fake_flashinfer.calls == {"rmsnorm": 2 * n, "fused_add_rmsnorm": (2 * layers - 1) * n,
                                     "silu_and_mul": layers * n}
    assert tracks(got, want) >= len(PROMPTS) * n // 2
    assert not any(torch.equal(g, w) for g, w in zip(got, want))


def test_a_real_model_s_greedy_tokens_are_the_same_with_the_fused_ops(fake_flashinfer):
    """SmolLM2-135M (the preset's weights, dequantized to bfloat16, so
    torch's path rather than the C layers runs it): free running through a
    prefill round and decode rounds, the fused ops give torch's greedy
    tokens, each round's logits tracking torch's. A trained model's top
    token stands clear of the rounding where a random one's often does not."""
    model, tok = load_model(None, "smollm2-135m", dtype="bfloat16", quantization="none",
                            attention="torch")
    assert model.native_layers is None and model.fused_ops is TORCH_OPS
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):\n    ",
                                       "Once upon a time, in a small village,")]
    want, want_tokens = rounds(model, prompts)
    model.fused_ops = FlashInferOps(fake_flashinfer)
    got, tokens = rounds(model, prompts)
    assert fake_flashinfer.calls["fused_add_rmsnorm"] == (2 * model.cfg.num_layers - 1) * \
        (STEPS + 1)
    assert tokens == want_tokens, [tok.decode(t) for t in tokens + want_tokens]
    tracks(got, want)


def test_lora_rows_through_the_fused_ops_track_torch_s(fake_flashinfer, tmp_path):
    """LoRA adds in place to the projections' outputs, which the fused
    residual add then reads (and overwrites): a batch of A, B and base
    rows, teacher forced, tracks the torch ops'."""
    pytest.importorskip("transformers")
    from pdserve.kernels.lora.adapter import load_adapter
    from support.lora import tiny_adapter, tiny_llama

    tiny_llama(tmp_path / "base")
    model, _ = load_model(str(tmp_path / "base"), None, dtype="bfloat16", attention="torch")
    model.enable_lora(slots=2, max_rank=8)
    model.lora.load(0, load_adapter(tiny_adapter(tmp_path / "a", seed=1), model.cfg))
    model.lora.load(1, load_adapter(tiny_adapter(tmp_path / "b", seed=2, rank=8), model.cfg))
    adapters = [0, 1, -1]
    want, want_tokens = rounds(model, PROMPTS, adapters=adapters)
    base, _ = rounds(model, PROMPTS, forced=want_tokens)
    assert not torch.allclose(base[0][:2], want[0][:2])     # the adapters change the logits
    model.fused_ops = FlashInferOps(fake_flashinfer)
    got, _ = rounds(model, PROMPTS, forced=want_tokens, adapters=adapters)
    assert fake_flashinfer.calls["fused_add_rmsnorm"] > 0
    assert tracks(got, want) >= len(PROMPTS) * (STEPS + 1) // 2


# ---- flashinfer's own kernels (CUDA) ----------------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("shape", ["llama-110m", "smollm2-135m"])
def test_flashinfer_s_fused_ops_give_the_unfused_greedy_tokens_on_cuda(shape):
    """bfloat16 on CUDA with flashinfer's attention, as a GPU engine runs
    (the fused ops chosen at build): teacher forced on the unfused path's
    greedy tokens through a prefill round and decode rounds, each
    round's logits within rounding of the unfused ones, and the same greedy
    token wherever the unfused top two logits are further apart than twice
    the largest difference (neither can then pass the other). Prints each
    path's eager decode step at three batch sizes."""
    model = model_of(shape, torch.bfloat16, "cuda", attention="flashinfer")
    assert model.fused_ops.name == "flashinfer", model.fused_ops_why
    fused = model.fused_ops
    prompts = [[(7 * s + 3 * i) % model.cfg.vocab_size for i in range(5 + 6 * s)]
               for s in range(8)]
    model.fused_ops = TORCH_OPS
    want, want_tokens = rounds(model, prompts)
    model.fused_ops = fused
    got, _ = rounds(model, prompts, forced=want_tokens)
    # not a vacuous check: a quarter of the rows at least are clear of the difference
    assert tracks(got, want) >= len(prompts) * len(want) // 4
    report = []
    for ops in (TORCH_OPS, fused):
        model.fused_ops = ops
        for batch in (1, 16, 64):
            ms = _decode_step_ms(model, batch, ctx=40)
            report.append(f"{shape} {ops.name} ops: eager decode step, batch {batch}: "
                          f"{ms:.2f} ms")
    print("\n".join(report))


def _decode_step_ms(model, batch: int, ctx: int) -> float:
    """The median eager decode step (ms) of `batch` sequences at `ctx`
    tokens (the caches' contents random)."""
    from pdserve.benchmarks.common.timing import median_ms

    dev = model.device
    cache = model.new_cache(batch * PAGES, PS)
    cache.data.normal_()
    tables = [list(range(i * PAGES, (i + 1) * PAGES)) for i in range(batch)]
    slots = torch.tensor([t[(ctx - 1) // PS] * PS + (ctx - 1) % PS for t in tables], device=dev)
    pos = torch.full((batch,), ctx - 1, device=dev)
    ids = torch.arange(batch, device=dev) % model.cfg.vocab_size
    rows = torch.arange(batch, device=dev)

    def step():
        meta = BatchMeta([SeqMeta(i, 1, ctx, tables[i]) for i in range(batch)], slots, pos,
                         num_decodes=batch)
        model.forward(ids, meta, cache, rows)

    return median_ms(step, 20, torch.cuda.synchronize)
