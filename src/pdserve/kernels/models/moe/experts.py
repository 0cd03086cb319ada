"""A layer's MLP in a mixture-of-experts model: `DenseMlp` (a gated SiLU
MLP, the dense layers' and a shared expert's) and `Experts`, the sparse
layers' router and routed experts.

A token's router scores pick its top k experts (Qwen3-MoE: softmax over all
of them; DeepSeek-V3: sigmoid scores, a correction bias that steers the
choice only, and the choice limited to the best groups of experts); it runs
those k and sums their outputs weighted by its scores. The round's
(token, expert) pairs are sorted by expert once, so each expert runs one
matmul pair over its tokens, in expert order; a token's k outputs are
added in that order, as transformers adds them.

Under tensor parallelism each rank's forward returns a partial sum that
the model all-reduces: with the experts' weights split (each rank a slice
of every expert's width) every rank runs every chosen expert on its
slice; with the experts sharded (expert parallelism: rank r holds experts
[first, first + count)) a rank runs only its own experts, over the tokens
that chose them, whole. The router is replicated, so every rank picks the
same experts for the same tokens. `counts` adds up, per expert, the tokens
routed to it (every rank sees every token: rank 0's counts are the
engine's), on the model's device.

Two ways to run the routed experts (`choose_experts_path`, at load): the
loop, one matmul pair an expert over its rows, whose row counts the host
reads (two waits on the device a layer; CPU, expert parallelism, and any
GPU where the other cannot run), and on CUDA in bfloat16 torch's grouped
matmul (`F.grouped_mm`: every expert's rows in one call, the row offsets
on the device), which never waits on the device. Its k outputs a token are
summed in float32, in the token's top-k order, deterministically (no
atomics); the loop's in expert order, in the model's dtype."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.models.model_config import ModelConfig
from pdserve.kernels.models.moe.specs import SIGMOID, MoeSpec


class ExpertsPath(enum.Enum):
    LOOP = "loop"           # a matmul pair an expert, its row counts read on the host
    GROUPED = "grouped"     # torch's grouped matmul over every expert, nothing read back


LOOP, GROUPED = ExpertsPath.LOOP, ExpertsPath.GROUPED


@dataclass
class DenseMlp:
    """silu(gate) * up, then down; gate and up fused in one weight [2I, H]."""
    gate_up: torch.Tensor
    down: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = F.linear(x, self.gate_up)
        inter = gu.shape[-1] // 2
        return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], self.down)


class Experts:
    """One sparse layer: the router [E, H], this rank's experts' fused
    gate/up [count, 2I, H] and down [count, H, I] (experts first ..
    first + count - 1), the correction bias (DeepSeek), the shared expert."""

    def __init__(self, spec: MoeSpec, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, first: int = 0, bias: torch.Tensor | None = None,
                 shared: DenseMlp | None = None):
        self.spec = spec
        self.router = router.float() if spec.router_fp32 else router
        self.bias = bias.float() if bias is not None else None
        self.gate_up, self.down = gate_up, down
        self.first, self.count = first, gate_up.shape[0]
        self.shared = shared
        self.counts = torch.zeros(spec.num_experts, dtype=torch.int64, device=gate_up.device)
        self.path = LOOP            # choose_experts_path's, set at load
        # a captured batch's real rows (kernels/capture.py sets it while its
        # step runs): the padding rows after them are routed but not counted
        self.live_rows: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k]) for each token of `x`."""
        s = self.spec
        if s.scoring != SIGMOID:
            logits = F.linear(x, self.router)
            top, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), s.top_k)
            if s.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return ids, top.to(logits.dtype)
        scores = torch.sigmoid(F.linear(x.float(), self.router))
        choice = scores + self.bias if self.bias is not None else scores
        if s.n_group > 1 and s.topk_group < s.n_group:
            grouped = choice.view(x.shape[0], s.n_group, -1)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(best, dtype=torch.bool)
            keep.scatter_(1, best.topk(s.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        ids = choice.topk(s.top_k, dim=-1).indices
        top = scores.gather(1, ids)
        if s.norm_topk_prob:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, top * s.routed_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the layer's output for every token of `x`:
        its experts' weighted outputs (and its part of the shared expert's)."""
        ids, weights = self.route(x)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)        # (token, expert) pairs grouped by expert
        # bincount would read its input's largest value back to size its output
        per_expert = torch.zeros_like(self.counts).scatter_add_(0, flat, torch.ones_like(flat))
        if self.live_rows is None:
            self.counts += per_expert
        else:
            pair = torch.arange(flat.numel(), device=flat.device)
            self.counts.scatter_add_(0, flat, (pair // ids.shape[1] < self.live_rows).long())
        routed = self._grouped if self.path == GROUPED else self._loop
        out = routed(x, order, per_expert, weights)
        if self.shared is not None:
            out = out + self.shared.forward(x)
        return out

    def _grouped(self, x: torch.Tensor, order: torch.Tensor, per_expert: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """Every expert's rows in one grouped matmul pair, nothing read back."""
        t, k = weights.shape
        offs = per_expert.cumsum(0).to(torch.int32)
        gu = F.grouped_mm(x.index_select(0, order // k), self.gate_up.transpose(1, 2),
                          offs=offs)
        inter = gu.shape[-1] // 2
        y = F.grouped_mm(F.silu(gu[:, :inter]) * gu[:, inter:], self.down.transpose(1, 2),
                         offs=offs)
        pairs = torch.empty_like(y).index_copy_(0, order, y)   # (token, its i-th choice)
        return (pairs.view(t, k, -1).float() * weights.float().unsqueeze(-1)).sum(1) \
            .to(x.dtype)

    def _loop(self, x: torch.Tensor, order: torch.Tensor, per_expert: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
        """A matmul pair for each of this rank's experts over its rows."""
        k = weights.shape[1]
        token = order // k
        weight = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        ends = per_expert.cumsum(0).tolist()
        start = ends[self.first - 1] if self.first else 0
        for e in range(self.count):
            end = ends[self.first + e]
            if end > start:
                rows = token[start:end]
                gu = F.linear(x[rows], self.gate_up[e])
                inter = gu.shape[-1] // 2
                y = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], self.down[e])
                out.index_add_(0, rows, (y * weight[start:end, None]).to(out.dtype))
            start = end
        return out


def choose_experts_path(layers: list[Experts], device,
                        dtype: torch.dtype) -> tuple[ExpertsPath, str]:
    """(path, why) for a model's sparse layers on `device` in `dtype`: the
    grouped matmul where it runs (tried once on the device, at these
    widths), else the loop."""
    dev = torch.device(device)
    if not layers:
        return LOOP, "no sparse layer"
    if dev.type != "cuda":
        return LOOP, "an expert's rows run as one matmul pair, counted on the host (CPU)"
    e = layers[0]
    if e.count < e.spec.num_experts:
        return LOOP, ("expert parallelism: this rank's experts are a block of the sorted rows, "
                      "which the host finds")
    if dtype != torch.bfloat16:
        return LOOP, f"torch's grouped matmul takes bfloat16 on CUDA, not {dtype}"
    try:                            # two experts at the layer's own widths
        offs = torch.tensor([1, 3], dtype=torch.int32, device=dev)
        x = torch.zeros(3, e.gate_up.shape[-1], dtype=dtype, device=dev)
        gu = F.grouped_mm(x, e.gate_up[:2].transpose(1, 2), offs=offs)
        F.grouped_mm(gu[:, :gu.shape[-1] // 2].contiguous(), e.down[:2].transpose(1, 2),
                     offs=offs)
    except Exception as err:        # an older card or build: say so, run the loop
        return LOOP, f"torch's grouped matmul failed here ({type(err).__name__}: {err})"
    return GROUPED, "torch's grouped matmul: every expert in one call, no wait on the device"


def use_experts_path(layers: list[Experts], device, dtype: torch.dtype) -> str:
    """Set the path `choose_experts_path` picks on every sparse layer; why."""
    path, why = choose_experts_path(layers, device, dtype)
    for e in layers:
        e.path = path
    return why


def stack_experts(w: dict, prefix: str, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [count, 2I, H], down [count, H, I]) of `experts` from a
    checkpoint's per-expert tensors under `prefix` (…mlp.experts.)."""
    gate_up = torch.stack([torch.cat([w[f"{prefix}{e}.gate_proj.weight"],
                                      w[f"{prefix}{e}.up_proj.weight"]]) for e in experts])
    down = torch.stack([w[f"{prefix}{e}.down_proj.weight"] for e in experts])
    return gate_up, down


def expert_weight_names(prefix: str, experts: int) -> list[str]:
    """A sparse layer's per-expert tensors, as checkpoints name them."""
    return [f"{prefix}mlp.experts.{e}.{proj}_proj.weight" for e in range(experts)
            for proj in ("gate", "up", "down")]


def moe_mlp(cfg: ModelConfig, w: dict, i: int, experts: range, router=None,
            bias=None, shared: DenseMlp | None = None) -> DenseMlp | Experts:
    """Layer i's MLP: its experts (this rank's `experts`) where the layer is
    sparse, else its dense MLP."""
    assert cfg.moe is not None
    p = f"model.layers.{i}."
    if not cfg.moe.is_sparse(i):
        return DenseMlp(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                        w[p + "mlp.down_proj.weight"])
    gate_up, down = stack_experts(w, p + "mlp.experts.", experts)
    return Experts(cfg.moe, w[p + "mlp.gate.weight"] if router is None else router, gate_up,
                   down, experts.start, bias, shared)
