"""Prefix reuse on a hybrid state model: what state checkpoints buy.

A hybrid model (Qwen3-Next-80B: 36 Gated DeltaNet layers beside 12
attention layers) can resume a cached prefix only where a state checkpoint
was kept (spec §1.2): its K/V pages alone are not enough. This benchmark
replays the Mooncake conversation trace, whose turns share leading 512-token
blocks (hash ids), through the simulator with the real planner, state
checkpoints on and off (engine.state_checkpoints), fused and 1P+1D, and
counts per run:

- hit: prompt tokens a prefill did not compute, the first admission's
  prefix hit (fused, P); on D, the K/V pages P did not ship (D's own hit).
- computed: prompt tokens the prefills computed, every chunk.
- slots: the most state slots held at once on one engine (working states,
  growth blocks, checkpoints in use), and the checkpoints cached at the end.

With checkpoints off a hybrid gets no prefix hit at all, however much K/V
is cached (vLLM's mamba_cache_mode=none); with them, every turn resumes at
the last checkpoint its prefix published.

`--real` runs the same comparison on this machine's CPU: a small Qwen3.5
with random weights (written here from the architecture's shapes) serves
multi-turn conversations, each turn's prompt the last one's prompt, answer
and a new message; greedy answers must come out the same both ways.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from pdserve.benchmarks.cache.bounds import HASH_BLOCK, ideal_hit
from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.traces import MOONCAKE_CONV, trace_file
from pdserve.config import ClusterShape, ServeConfig, SimulateConfig
from pdserve.sim.simulation import Simulation
from pdserve.sim.report import percentile
from pdserve.sim.trace import read_trace
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.round.grammar import Role

MODEL, GPU = "qwen3-next-80b", "h100"
PAGE = 16
BLOCK = HASH_BLOCK         # a state checkpoint every Mooncake hash block
LIMIT = 1000
# one engine's pools: ~220 GiB of K/V at 384 KiB a page, ~110 GiB of state
# at 73.7 MiB a slot (an 8-GPU node's share; state_capacity.py's arithmetic)
TOTAL_PAGES = 600_000
STATE_SLOTS = 1536
RUNS = (("fused", True), ("fused", False), ("1P+1D", True), ("1P+1D", False))


def config(shape: str, checkpoints: bool, block: int = BLOCK,
           slots: int = STATE_SLOTS) -> ServeConfig:
    engine = EngineConfig(page_size=PAGE, total_pages=TOTAL_PAGES, state_slots=slots,
                          state_block=block, state_checkpoints=checkpoints,
                          max_scheduled_tokens=8192, max_batch_size=256,
                          max_context_tokens=262144)
    # one engine computes prompts either way, so both see the same prefixes
    cluster = ClusterShape(prefill=0, decode=0, fused=1) if shape == "fused" else \
        ClusterShape(prefill=1, decode=1, fused=0)
    return ServeConfig(engine=engine, cluster=cluster,
                       simulate=SimulateConfig(gpu=GPU, model=MODEL))


class PrefillCount:
    """What the prefills of the plans an executor runs computed: prompt
    tokens, and of each request's first admission its prefix hit (the
    first token it computed)."""

    def __init__(self, executor):
        self.hit = self.prompt = self.computed = 0
        self.seen: set = set()
        run = executor.run

        def watched(plan):
            self.count(plan)
            return run(plan)
        executor.run = watched          # this instance only

    def count(self, plan) -> None:
        for op in plan.prefills:
            self.computed += op.tokens
            if op.req.id not in self.seen:
                self.seen.add(op.req.id)
                self.hit += op.begin
                self.prompt += op.req.prompt_len


class Tally(PrefillCount):
    """Counts what one simulated engine's plans asked for: its prefills, the
    remote prefills D asks for (the pages P did not ship are D's hit), and
    the most state slots held at once."""

    def __init__(self, se):
        self.role = se.role
        self.peak_slots = 0
        planner = se.engine.planner
        self.coord, self.page_size = planner.coord, planner.page_size
        super().__init__(se.engine.executor)

    def count(self, plan) -> None:
        super().count(plan)
        for op in plan.remote_prefills:
            self.hit += op.first_page * self.page_size
            self.prompt += op.req.prompt_len
        g = self.coord.state
        grp = self.coord.groups[g]
        used = grp.pool.total - self.coord.available_pages(g)
        self.peak_slots = max(self.peak_slots, used)

    @property
    def cached(self) -> int:
        return self.coord.groups[self.coord.state].index.num_cached


def simulate(cfg: ServeConfig, trace) -> dict:
    t0 = time.perf_counter()
    sim = Simulation(cfg, trace, progress=False)
    tallies = [Tally(se) for se in sim.engines]
    res = sim.run()
    rows = [r for r in res["requests"] if r["status"] == "finished"]
    ttft = [r["ttft_s"] for r in rows]

    def side(roles):
        ts = [t for t in tallies if t.role in roles]
        return {"hit": sum(t.hit for t in ts), "prompt": sum(t.prompt for t in ts),
                "computed": sum(t.computed for t in ts),
                "slots": max(t.peak_slots for t in ts), "cached": sum(t.cached for t in ts)}
    return {"prefill": side((Role.FUSED, Role.PREFILL)), "decode": side((Role.DECODE,))
            if any(t.role is Role.DECODE for t in tallies) else None,
            "finished": res["summary"]["finished"], "n": len(trace),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "wall_s": time.perf_counter() - t0}


# ---- the real engine on CPU --------------------------------------------------

SMALL = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
         "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 8, "full_attention_interval": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
         "linear_conv_kernel_dim": 4, "max_position_embeddings": 8192,
         "tie_word_embeddings": True, "eos_token_id": 0, "dtype": "float32"}


def write_random_qwen3_5(d: Path, seed: int = 0) -> Path:
    """A Qwen3.5 text checkpoint (config.json, model.safetensors) of SMALL's
    shapes with seeded random weights."""
    import torch
    from safetensors.torch import save_file

    from pdserve.kernels.models.model_config import read_config
    from pdserve.kernels.models.qwen3_5 import qwen3_5_weight_names

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(SMALL))
    c = read_config(d)
    h, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
    vd = c.linear_num_value_heads * c.linear_value_head_dim
    shapes = {
        "embed_tokens.weight": (c.vocab_size, h), "q_proj.weight": (2 * c.num_heads * hd, h),
        "k_proj.weight": (c.num_kv_heads * hd, h), "v_proj.weight": (c.num_kv_heads * hd, h),
        "o_proj.weight": (h, c.num_heads * hd), "q_norm.weight": (hd,), "k_norm.weight": (hd,),
        "in_proj_qkv.weight": (c.conv_dim, h), "in_proj_z.weight": (vd, h),
        "in_proj_b.weight": (c.linear_num_value_heads, h),
        "in_proj_a.weight": (c.linear_num_value_heads, h),
        "conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel),
        "A_log": (c.linear_num_value_heads,), "dt_bias": (c.linear_num_value_heads,),
        "out_proj.weight": (h, vd), "gate_proj.weight": (inter, h),
        "up_proj.weight": (inter, h), "down_proj.weight": (h, inter),
    }
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in qwen3_5_weight_names(c):
        key = ".".join(name.split(".")[-2:]) if not name.endswith(("A_log", "dt_bias")) \
            else name.split(".")[-1]
        if name.endswith("linear_attn.norm.weight"):
            shape = (c.linear_value_head_dim,)
        elif name.endswith("layernorm.weight") or name == "model.norm.weight":
            shape = (h,)
        else:
            shape = shapes[key]  # type: ignore[assignment]
        scale = 0.3 if "norm" in name else 1 / shape[-1] ** 0.5
        out[name] = (torch.randn(shape, generator=g) * scale).contiguous()
    save_file(out, str(d / "model.safetensors"))
    return d


def conversations(n: int, turns: int, first: int, message: int, seed: int = 1):
    """Per conversation, the new message of each turn (token ids)."""
    import random

    rng = random.Random(seed)
    return [[[rng.randrange(1, SMALL["vocab_size"]) for _ in range(first if t == 0 else message)]  # type: ignore[arg-type]
             for t in range(turns)] for _ in range(n)]


def real(block: int, convs: int = 4, turns: int = 4, answer: int = 16) -> int:
    from pdserve import LLM, SamplingParams

    talks = conversations(convs, turns, 200, 40)
    sp = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    print(f"the real engine on CPU: a random Qwen3.5 ({SMALL['num_hidden_layers']} layers, "
          f"3 Gated DeltaNet to 1 attention), {convs} conversations x {turns} turns, "
          f"first message 200 tokens, then 40, answers {answer}; pages of 16, a state "
          f"checkpoint every {block} tokens")
    print()
    print(f"{'ckpts':<5} {'prompt tok':>10} {'hit tok':>8} {'hit %':>6} {'computed':>9} "
          f"{'wall s':>7}")
    answers = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = write_random_qwen3_5(Path(tmp) / "qwen3_5")
        for ckpt in (False, True, False, True):
            llm = LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch",
                      page_size=16, total_pages=512, max_scheduled_tokens=256,
                      max_batch_size=8, state_block=block, state_checkpoints=ckpt)
            n = PrefillCount(llm.executor)
            t0 = time.perf_counter()
            history: list[list[int]] = [[] for _ in talks]
            outs = []
            for t in range(turns):
                ps = [h + talk[t] for h, talk in zip(history, talks)]
                got = [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
                history = [p + a for p, a in zip(ps, got)]
                outs.append(got)
            answers[ckpt] = outs
            llm.engine.planner.assert_idle()
            print(f"{'on' if ckpt else 'off':<5} {n.prompt:>10,} {n.hit:>8,} "
                  f"{100 * n.hit / n.prompt:>6.1f} {n.computed:>9,} "
                  f"{time.perf_counter() - t0:>7.1f}")
    same = answers[True] == answers[False]
    print()
    print(f"greedy answers {'identical' if same else 'DIFFER'} with checkpoints on and off")
    return 0 if same else 1


def main(trace_path: str | None, limit: int, block: int, slots: int = STATE_SLOTS) -> int:
    trace = read_trace(trace_file(trace_path, MOONCAKE_CONV), limit=limit)
    print(f"{MODEL} on simulated {GPU}s, the first {len(trace)} Mooncake conversation requests; "
          f"pages of {PAGE} tokens, a state checkpoint every {block} tokens, "
          f"{slots} state slots an engine")
    print()
    head = (f"{'engines':<7} {'ckpts':<5} {'side':<7} {'prompt tok':>11} {'hit tok':>11} "
            f"{'hit %':>6} {'computed':>11} {'slots peak':>10} {'cached':>6} "
            f"{'TTFT p50':>9} {'p90':>8} {'done':>5} {'wall s':>6}")
    print(head)
    total, best = ideal_hit(trace)
    print(f"{'ideal':<7} {'':<5} {'':<7} {total:>11,} {best:>11,} {100 * best / total:>6.1f} "
          f"{total - best:>11,}")
    for shape, ckpt in RUNS:
        r = simulate(config(shape, ckpt, block, slots), trace)
        sides = [("fused" if shape == "fused" else "P", r["prefill"])]
        if r["decode"]:
            sides.append(("D", r["decode"]))
        for i, (name, s) in enumerate(sides):
            share = 100 * s["hit"] / s["prompt"] if s["prompt"] else 0.0
            tail = (f"{r['ttft_p50_s']:>9.3f} {r['ttft_p90_s']:>8.3f} {r['finished']:>5} "
                    f"{r['wall_s']:>6.1f}") if i == 0 else ""
            print(f"{shape:<7} {'on' if ckpt else 'off':<5} {name:<7} {s['prompt']:>11,} "
                  f"{s['hit']:>11,} {share:>6.1f} {s['computed']:>11,} {s['slots']:>10,} "
                  f"{s['cached']:>6,} {tail}")
    print()
    print("hit: prompt tokens not computed (fused, P: the prefix hit; D: K/V pages P did not "
          "ship). ideal: each prompt's longest run of hash blocks an earlier request had, as "
          "if everything stayed cached. slots peak: state slots held at once on one engine; "
          "cached: checkpoints cached at the end")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="a Mooncake-format trace (the conversation "
                   "trace in ../shared/data/traces)")
    p.add_argument("--limit", type=positive, default=LIMIT,
                   help=f"requests from the start of the trace ({LIMIT})")
    p.add_argument("--block", type=positive, default=BLOCK,
                   help=f"tokens between state checkpoints, engine.state_block ({BLOCK})")
    p.add_argument("--state-slots", type=positive, default=STATE_SLOTS,
                   help=f"state slots an engine, engine.state_slots ({STATE_SLOTS})")
    p.add_argument("--real", action="store_true",
                   help="run a small random Qwen3.5 on this CPU instead of simulating")


def run(args) -> int:
    if args.real:
        return real(min(args.block, 64) if args.block == BLOCK else args.block)
    return main(args.trace, args.limit, args.block, args.state_slots)
