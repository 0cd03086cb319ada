"""LoRA test helpers: a tiny random Llama saved as a Hugging Face checkpoint,
and random PEFT adapters for it, written as PEFT writes them
(adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.kernels.lora.adapter import MODULES
from pdserve.scheduler import Planner, Request, SamplingLimits
from pdserve.scheduler.fsm import Retracted
from pdserve.scheduler.lora.slots import AdapterSlots
from support.planner import result_for

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_llama(d: Path, seed: int = 0):
    """A random LlamaForCausalLM (float32, eval) saved under `d`."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().eval()
    with torch.no_grad():               # non-trivial norms, so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(d, safe_serialization=True)
    return model


def shapes(hidden: int, inter: int, q: int, kv: int) -> dict:
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def write_adapter(d: Path, *, layers: int, dims: dict, rank: int = 4, alpha: float = 8.0,
                  targets=MODULES, seed: int = 1, scale: float = 0.3, **extra) -> Path:
    """A random LoRA adapter as PEFT saves it (B non-zero, unlike a fresh one)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for m in targets:
            out, inp = dims[m]
            part = "self_attn" if m in MODULES[:4] else "mlp"
            p = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[p + ".lora_A.weight"] = torch.randn(rank, inp, generator=g) * scale / inp ** .5
            tensors[p + ".lora_B.weight"] = torch.randn(out, rank, generator=g) * scale / rank ** .5
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
            "bias": "none", "use_rslora": False, "use_dora": False, **extra}
    (d / "adapter_config.json").write_text(json.dumps(conf))
    return d


def tiny_adapter(d: Path, seed: int, **kw) -> Path:
    """A random adapter for `tiny_llama`'s shapes."""
    t = TINY
    head = t["hidden_size"] // t["num_attention_heads"]
    dims = shapes(t["hidden_size"], t["intermediate_size"], t["hidden_size"],
                  t["num_key_value_heads"] * head)
    return write_adapter(d, layers=t["num_hidden_layers"], dims=dims, seed=seed, **kw)


PROMPTS = [[5, 17, 42, 9, 3, 77, 12, 8, 30, 2, 61], [94, 3, 7], list(range(1, 20))]


def greedy(n=8):
    from pdserve import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def under(rid: str, adapter: int, n: int = 12, max_new: int = 6) -> Request:
    prompt = [(hash((rid, i)) % 500) + 1 for i in range(n)]
    return Request(rid, prompt, SamplingLimits(max_new_tokens=max_new), adapter=adapter)


def drive(p: Planner, slots: AdapterSlots, max_rounds: int = 2000) -> dict:
    """Run to the end, checking every round that no slot changed hands while
    referenced and no round mixes more adapters than slots; returns how
    often each slot changed hands and whether a retracted request held one."""
    seen = {"rotations": 0, "retracted_holding": False}
    holders = list(slots.holder)
    for _ in range(max_rounds):
        if not p.has_work():
            return seen
        plan = p.build()
        for s, (before, now) in enumerate(zip(holders, slots.holder)):
            if before != now:
                seen["rotations"] += 1
                users = [r.id for r in p.requests.values() if r.adapter == before
                         and r.lora_slot == s]
                assert not users, f"slot {s} went to load {now} while {users} use load {before}"
        holders = list(slots.holder)
        rows = [op.req for op in plan.prefills] + list(plan.decodes)
        assert len({r.adapter for r in rows if r.adapter}) <= slots.slots
        assert all(r.lora_slot >= 0 for r in rows if r.adapter)
        p.apply(plan, result_for(plan))
        p.check_invariants()
        seen["retracted_holding"] |= any(isinstance(r.state, Retracted) and r.lora_slot >= 0
                                         for r in p.requests.values())
    raise AssertionError("did not finish")
