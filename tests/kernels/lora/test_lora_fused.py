"""The fused batched LoRA (Triton, `kernels/lora/fused.py`): under Triton's
interpreter on CPU tensors, its rows equal the merged weights and the torch
segmented path; on a GPU (marked `device`), the compiled kernels do too.
The CPU picks the torch path."""

import pytest
import torch

from pdserve.kernels.lora.batched import LoraRound, LoraSegments
from pdserve.kernels.lora.adapter import load_adapter, merged
from pdserve.kernels.lora.fused import FusedLoraRound, lora_round, segment_table
from test_lora_kernels import base_weights, batch, logits, ours, setup
from support.lora import PROMPTS  # noqa: F401
from test_lora_segments import model  # noqa: F401


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter: the kernels run on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def fused_logits(model, prompts, slots):
    """Last-token logits of each prompt, prompt i under slot `slots[i]`, fused."""
    ids, meta, cache, last = batch(model, prompts)
    rows = [s for p, s in zip(prompts, slots) for _ in p]
    rnd = FusedLoraRound.of(model.lora, rows)
    return model.forward(ids, meta, cache, last, lora=rnd)


def test_the_segment_table_lists_every_group_slot_by_slot():
    """Batched and alone groups alike, each row once, base rows in none."""
    seg = LoraSegments.of([0, -1, 1] + [2] * 40 + [3, -1, 1])
    rows, starts, lens, slots = segment_table(seg)
    assert slots == [0, 1, 2, 3] and lens == [1, 2, 40, 1]
    assert starts == [0, 1, 3, 43]
    assert rows == [0, 2, 45] + list(range(3, 43)) + [43]


def test_fused_rows_equal_the_merged_weights_under_the_interpreter(setup, interpreted):
    """Base, A and B prompts in one forward (B of rank 8 on q, v and down;
    A of rank 4 on all seven): each row's logits equal a model with its
    adapter merged in, to 1e-5 in float32."""
    _, base, a_dir, b_dir = setup
    model = ours(base)
    a, b = load_adapter(a_dir, model.cfg), load_adapter(b_dir, model.cfg)
    model.enable_lora(slots=3, max_rank=8)
    model.lora.load(0, a)
    model.lora.load(2, b)
    got = fused_logits(model, PROMPTS, [2, -1, 0])
    for i, adapter in enumerate([b, None, a]):
        ref = ours(base, merged(base_weights(base), adapter) if adapter else None)
        want = logits(ref, [PROMPTS[i]])[0]
        assert torch.allclose(got[i], want, atol=1e-5, rtol=0), (i, (got[i] - want).abs().max())


def test_fused_rows_equal_the_torch_path_under_the_interpreter(model, interpreted):  # noqa: F811
    """Five adapters of ranks 1-8 and two target sets: a prefill chunk beside
    decode rows, groups of uneven length, a base row; the fused round's
    logits equal the torch segmented round's."""
    prompts = [list(range(1, 25)), [7, 8], [9, 10, 11], [12], [13, 14], [15, 16, 17]]
    slots = [5, 6, 9, 3, -1, 6]
    ids, meta, cache, last = batch(model, prompts)
    rows = [s for p, s in zip(prompts, slots) for _ in p]
    want = model.forward(ids, meta, cache, last, lora=LoraRound.of(model.lora, rows))
    got = fused_logits(model, prompts, slots)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("max_rank", [24, 32])
def test_a_rank_above_the_tiles_equals_the_torch_path(interpreted, max_rank):
    """max_rank 24 and 32 (past one 16-wide tile; 24 is no power of two)
    and a round mixing a 20-row group, short groups and base rows: every
    fused matmul's delta equals the torch path's, base rows untouched."""
    from pdserve.kernels.lora.batched import GROUPS, LoraStacks
    from pdserve.kernels.models.model_config import ModelConfig
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=128, max_position=512)
    g = torch.Generator().manual_seed(3)
    stacks = LoraStacks(cfg, 4, max_rank, torch.float32, "cpu")
    for group in range(len(GROUPS)):
        A = stacks.A[0][group]
        A.copy_(torch.randn(A.shape, generator=g) / A.shape[1] ** .5)
        for B in stacks.B[0][group]:
            B.copy_(torch.randn(B.shape, generator=g) / max_rank ** .5)
    row_slots = [1, -1] + [3] * 20 + [0, 1, -1, 2]
    fused, torch_path = FusedLoraRound.of(stacks, row_slots), LoraRound.of(stacks, row_slots)
    base = [i for i, s in enumerate(row_slots) if s < 0]
    for group in range(len(GROUPS)):
        x = torch.randn(len(row_slots), stacks.A[0][group].shape[1], generator=g)
        y = torch.randn(len(row_slots), sum(B.shape[2] for B in stacks.B[0][group]), generator=g)
        got, want = fused.add(0, group, x, y.clone()), torch_path.add(0, group, x, y.clone())
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (group, (got - want).abs().max())
        assert torch.equal(got[base], y[base])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_kernels_compile_for_a_gpu_on_a_host_without_one(dtype, tmp_path, monkeypatch):
    """The path the interpreter skips: Triton compiles both kernels for
    sm_90 (an H100 or H200) down to a cubin through ptxas, here, with no
    GPU. Float32 multiplies at IEEE precision (no TF32 in its PTX, no tensor
    cores); bfloat16 uses the tensor cores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.kernels.lora.triton_kernels import kernels
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")          # its default, said aloud
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    shrink, expand = kernels(False)
    index = {p: "*i64" for p in ("rows_ptr", "starts_ptr", "lens_ptr", "slots_ptr")}
    built = {}
    for name, fn, sig, const in (
        ("shrink", shrink,
         {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "s_ptr": "*fp32", **index,
          **dict.fromkeys(("K", "N", "stride_xm", "stride_as", "stride_ak", "stride_sm"), "i32")},
         {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "FP32": dtype == "fp32"}),
        ("expand", expand,
         {"s_ptr": "*fp32", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", **index,
          **dict.fromkeys(("N", "R", "s_col", "y_col", "stride_sm", "stride_bs", "stride_br",
                           "stride_ym"), "i32")},
         {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_R": 16, "FP32": dtype == "fp32"})):
        sig.update(dict.fromkeys(const, "constexpr"))
        built[name] = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32))
        assert built[name].asm["cubin"]
    ptx = built["shrink"].asm["ptx"]
    if dtype == "fp32":
        assert "tf32" not in ptx and "mma" not in ptx
    else:
        assert "mma" in ptx


def test_a_cpu_round_takes_the_torch_path(model):  # noqa: F811
    assert isinstance(lora_round(model.lora, LoraSegments.of([0, 1, -1])), LoraRound)


@pytest.mark.device
def test_fused_lora_on_cuda_equals_the_merged_weights(setup):
    """On a GPU the executor's round is the fused one; compiled, its mixed
    batch's rows equal the merged models' on the CPU (float32, IEEE dots)."""
    from pdserve.kernels.models.loader import load_model
    _, base, a_dir, b_dir = setup
    model, _ = load_model(str(base), None, dtype="float32", device="cuda", attention="torch")
    a, b = load_adapter(a_dir, model.cfg), load_adapter(b_dir, model.cfg)
    model.enable_lora(slots=2, max_rank=8)
    model.lora.load(0, a)
    model.lora.load(1, b)
    ids, meta, cache, last = batch(model, PROMPTS)
    rows = [s for p, s in zip(PROMPTS, [0, 1, -1]) for _ in p]
    rnd = lora_round(model.lora, LoraSegments.of(rows))
    assert isinstance(rnd, FusedLoraRound)
    meta.slot_mapping, meta.positions = meta.slot_mapping.cuda(), meta.positions.cuda()
    got = model.forward(ids.cuda(), meta, cache, last.cuda(), lora=rnd).cpu()
    for i, adapter in enumerate([a, b, None]):
        ref = ours(base, merged(base_weights(base), adapter) if adapter else None)
        want = logits(ref, [PROMPTS[i]])[0]
        assert torch.allclose(got[i], want, atol=1e-4, rtol=1e-4), (got[i] - want).abs().max()
