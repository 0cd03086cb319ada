"""The torch executor: carries a plan out on a real model.

Order within a round is the spec's stream order: host stores first (the
retraction snapshots among them read pages the plan has already granted to
someone else), then loads back from host, then the forward. Fresh pages are
not zeroed: attention reads only positions a request has written. Every copy
finishes within the round (on a GPU: queued on one stream, then one sync),
so every store and load is acked in the result.

Each cache group (the model's `cache_groups()`) has its own device pool and
host pool, and each request its own block table per group. A round's
forward gets one BatchMeta per group: a sliding group's sequences read from
their window's first page on (slots below are HOLE), and replay rows write
their K/V only into replayable groups (spec §1.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kernels.attention import BatchMeta, KVCache, SeqMeta
from pdserve.kernels.detokenize import Detokenizer
from pdserve.kernels.model_config import ModelError
from pdserve.kernels.sampling import Logprob, SamplingParams, sample
from pdserve.kernels.staging import stage_rows
from pdserve.scheduler.cache_groups import HOLE
from pdserve.scheduler.capacity import group_pages
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.plan import Plan, StepResult


@dataclass
class Tracked:
    """What the executor keeps for a live request: how it samples, its text
    so far, and the logprobs of its tokens not yet handed out."""
    params: SamplingParams
    seed: int
    detok: Detokenizer | None       # None: text is made elsewhere (an engine's output thread)
    logprobs: list = field(default_factory=list)
    tokens: int = 0                 # tokens taken (on_token calls)


class TorchExecutor:
    def __init__(self, model, tokenizer, cfg: EngineConfig, detokenize: bool = True,
                 groups=None):
        """`detokenize=False`: tokens only; stop strings are then found by
        whoever makes the text (roles/outputs.py). `groups`: the planner's
        CacheGroupSpecs, by default the model's `cache_groups()` (sliding
        groups replayable when engine.sliding_replay is set); they must lay
        out the model's layers as the model does (replayable may differ)."""
        if model.cfg.state_layers():
            raise ModelError(f"{model.cfg.arch}: layers {list(model.cfg.state_layers())} keep a "
                             "recurrent state, which the engine cannot schedule yet (state "
                             "cache groups, issue 14); serve a model whose layers all keep K/V")
        self.model = model
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.page_size = cfg.page_size
        self.groups = list(groups) if groups is not None \
            else model.cache_groups(replayable=cfg.sliding_replay)
        _check_groups(self.groups, model.cache_groups())
        self.caches = model.new_caches(group_pages(cfg, self.groups), cfg.page_size)
        self.hosts = []
        if cfg.host_pages:
            c = model.cfg
            # page-locked beside a GPU (exactly its size, not torch's power of
            # two): stores and loads are then DMA straight between the pools
            self.hosts = [KVCache(len(g.layers), cfg.host_pages, cfg.page_size, c.num_kv_heads,
                                  c.head_dim, model.dtype, "cpu",
                                  pin_memory=model.device.type == "cuda")
                          for g in self.groups]
        # the first group's pools, for callers that know one group
        self.cache = self.caches[0]
        self.host = self.hosts[0] if self.hosts else None
        self.eos = set(model.cfg.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            self.eos.add(tok_eos)
        self._eos_ids = frozenset(self.eos)
        self.tracked: dict[str, Tracked] = {}
        self.forward_tokens = 0

    # ---- per-request sampling state ---------------------------------------
    def register(self, req_id: str, params: SamplingParams, fallback_seed: int,
                 prompt=()) -> None:
        detok = Detokenizer(self.tokenizer, prompt, params.stop) if self.detokenize else None
        self.tracked[req_id] = Tracked(params, fallback_seed, detok)

    def params(self, req_id: str) -> SamplingParams:
        return self.tracked[req_id].params

    def forget(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)

    def on_token(self, req, token: int, logprob: Logprob | None = None) -> bool:
        """Take `token`, sampled next for `req`: extend its text and logprobs;
        True if it ends the request (EOS, a stop id, or, when this executor
        detokenizes, a stop string). Every token of a request passes here
        once, in order."""
        t = self.tracked[req.id]
        sp = t.params
        t.tokens += 1
        if logprob is not None:
            t.logprobs.append(logprob)
        early = t.tokens < sp.min_tokens
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos):
            if not early:
                return True         # a stop token's text is not part of the answer
        if t.detok is None:
            return False
        stopped = t.detok.push(token, check_stop=not early)
        t.detok.ready()             # hand the text on as it comes: no string grows per token
        return stopped

    # ---- one round ----------------------------------------------------------
    def run(self, plan: Plan) -> StepResult:
        result = StepResult()
        for s in plan.stores:
            self.hosts[s.group].copy_pages_from(self.caches[s.group], s.device_pages,
                                                s.host_pages)
            result.stores_done.append(s.id)
        for ld in plan.loads:
            self.caches[ld.group].copy_pages_from(self.hosts[ld.group], ld.host_pages,
                                                  ld.device_pages)
            result.loads_done.append(ld.id)
        if (plan.stores or plan.loads) and self.cache.data.is_cuda:
            # the copies are queued on the stream: done before they are acked
            torch.cuda.current_stream(self.cache.data.device).synchronize()
        if not (plan.prefills or plan.decodes):
            return result
        logits, rows = self.forward(plan)
        tokens = []
        if rows:
            tracked = [self.tracked[r.id] for r in rows]
            tokens, logprobs = sample(logits, [t.params for t in tracked],
                                      [len(r.output) for r in rows], [t.seed for t in tracked],
                                      self._eos_ids)
        else:
            logprobs = []
        it = iter(zip(rows, tokens, logprobs))
        for op in plan.prefills:
            if op.completes:
                req, tok, lp = next(it)
                result.prefill_tokens.append(tok)
                if self.on_token(req, tok, lp):
                    result.stopped.add(req)
            else:
                result.prefill_tokens.append(None)
        for req, tok, lp in it:
            result.decode_tokens.append(tok)
            if self.on_token(req, tok, lp):
                result.stopped.add(req)
        return result

    def forward(self, plan: Plan):
        """The round's forward: (logits of the rows that sample, float32, and
        their requests, in order: completing prefills, then decodes)."""
        ps = self.page_size
        groups = self.groups
        ids, pos, sample_rows, rows = [], [], [], []
        seqs = [[] for _ in groups]
        slots = [[] for _ in groups]
        skips = [False] * len(groups)
        for op in plan.prefills:
            req = op.req
            toks = req.prompt.tokens + req.output
            begin, end = op.begin - op.replay, op.begin + op.tokens
            q0 = len(ids)
            ids.extend(toks[begin:end])
            pos.extend(range(begin, end))
            for g, spec in enumerate(groups):
                table = req.state.res.tables[g]
                # replay rows' K/V go only where the group regenerates them
                keeps = not op.replay or spec.replayable
                first = begin if keeps else op.begin
                kv_start = 0
                if spec.sliding:
                    kv_start = begin if op.replay and spec.replayable \
                        else max(begin - spec.window + 1, 0)
                    _check_live(table, kv_start, end, ps, req, g)
                seqs[g].append(SeqMeta(q0, end - begin, end, table, kv_start))
                if not keeps:
                    slots[g].extend([-1] * op.replay)
                    skips[g] = True
                slots[g].extend(table[p // ps] * ps + p % ps for p in range(first, end))
            if op.completes:
                sample_rows.append(len(ids) - 1)
                rows.append(req)
        for req in plan.decodes:
            p = req.num_tokens - 1
            for g, spec in enumerate(groups):
                table = req.state.res.tables[g]
                kv_start = 0
                if spec.sliding:
                    kv_start = max(p - spec.window + 1, 0)
                    _check_live(table, kv_start, p + 1, ps, req, g)
                seqs[g].append(SeqMeta(len(ids), 1, p + 1, table, kv_start))
                slots[g].append(table[p // ps] * ps + p % ps)
            ids.append(req.output[-1] if req.output else req.prompt.tokens[-1])
            pos.append(p)
            sample_rows.append(len(ids) - 1)
            rows.append(req)
        writes = [[i for i, s in enumerate(sl) if s >= 0] if skip else []
                  for sl, skip in zip(slots, skips)]
        # one host tensor, one (asynchronous) copy for the round's lists
        staged = stage_rows([ids, pos, sample_rows, *slots, *writes], self.model.device)
        ids_t, pos_t, rows_t = staged[:3]
        n = len(groups)
        metas = [BatchMeta(seqs[g], staged[3 + g], pos_t, num_decodes=len(plan.decodes),
                           window=spec.window if spec.sliding else None,
                           write_rows=staged[3 + n + g] if skips[g] else None)
                 for g, spec in enumerate(groups)]
        self.forward_tokens += len(ids)
        logits = self.model.forward(ids_t, metas, self.caches, rows_t)
        return logits, rows


def _check_groups(groups, model_groups) -> None:
    """The planner's groups must lay out the model's layers as the model does."""
    def shape(gs):
        return [(g.retention, g.window, tuple(g.layers)) for g in gs]

    if shape(groups) != shape(model_groups):
        raise ValueError(f"cache groups {shape(groups)} (retention, window, layers) are not "
                         f"the model's {shape(model_groups)}; build them with "
                         "model.cache_groups()")


def _check_live(table, kv_start: int, end: int, ps: int, req, g: int) -> None:
    """A sliding group's forward reads and writes slots [kv_start // ps,
    end / ps): none of them may be a page the group let go."""
    live = table[kv_start // ps: -(-end // ps)]
    if HOLE in live or len(live) < -(-end // ps) - kv_start // ps:
        raise RuntimeError(f"request {req.id}: cache group {g}'s table {table} lacks a page "
                           f"in slots [{kv_start // ps}, {-(-end // ps)}) that the forward "
                           f"over positions [{kv_start}, {end}) reads")
