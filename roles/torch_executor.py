"""The torch executor: carries a plan out on a real model.

Order within a round is the spec's stream order: host stores first (the
retraction snapshots among them read pages the plan has already granted to
someone else), then loads back from host, then the forward. Fresh pages are
not zeroed: attention reads only positions a request has written. Every copy
finishes within the round (on a GPU: queued on one stream, then one sync),
so every store and load is acked in the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kernels.attention import BatchMeta, KVCache, SeqMeta
from pdserve.kernels.detokenize import Detokenizer
from pdserve.kernels.sampling import Logprob, SamplingParams, sample
from pdserve.kernels.staging import stage_rows
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
    def __init__(self, model, tokenizer, cfg: EngineConfig, detokenize: bool = True):
        """`detokenize=False`: tokens only; stop strings are then found by
        whoever makes the text (roles/outputs.py)."""
        self.model = model
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.page_size = cfg.page_size
        self.cache = model.new_cache(cfg.total_pages, cfg.page_size)
        self.host = None
        if cfg.host_pages:
            c = model.cfg
            # page-locked beside a GPU (exactly its size, not torch's power of
            # two): stores and loads are then DMA straight between the pools
            self.host = KVCache(c.num_layers, cfg.host_pages, cfg.page_size, c.num_kv_heads,
                                c.head_dim, model.dtype, "cpu",
                                pin_memory=model.device.type == "cuda")
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
            self.host.copy_pages_from(self.cache, s.device_pages, s.host_pages)
            result.stores_done.append(s.id)
        for ld in plan.loads:
            self.cache.copy_pages_from(self.host, ld.host_pages, ld.device_pages)
            result.loads_done.append(ld.id)
        if (plan.stores or plan.loads) and self.cache.data.is_cuda:
            # the copies are queued on the stream: done before they are acked
            torch.cuda.current_stream(self.cache.data.device).synchronize()
        if not (plan.prefills or plan.decodes):
            return result
        logits, rows = self._forward(plan)
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

    def _forward(self, plan: Plan):
        ps = self.page_size
        ids, pos, slots, seqs, sample_rows, rows = [], [], [], [], [], []
        for op in plan.prefills:
            req = op.req
            table = req.state.res.tables[0]
            toks = req.prompt.tokens + req.output
            begin, end = op.begin - op.replay, op.begin + op.tokens
            seqs.append(SeqMeta(len(ids), end - begin, end, table))
            ids.extend(toks[begin:end])
            pos.extend(range(begin, end))
            slots.extend(table[p // ps] * ps + p % ps for p in range(begin, end))
            if op.completes:
                sample_rows.append(len(ids) - 1)
                rows.append(req)
        for req in plan.decodes:
            table = req.state.res.tables[0]
            p = req.num_tokens - 1
            seqs.append(SeqMeta(len(ids), 1, p + 1, table))
            ids.append(req.output[-1] if req.output else req.prompt.tokens[-1])
            pos.append(p)
            slots.append(table[p // ps] * ps + p % ps)
            sample_rows.append(len(ids) - 1)
            rows.append(req)
        # one host tensor, one (asynchronous) copy for the round's four lists
        ids_t, pos_t, slots_t, rows_t = stage_rows([ids, pos, slots, sample_rows],
                                                   self.model.device)
        meta = BatchMeta(seqs, slots_t, pos_t, num_decodes=len(plan.decodes))
        self.forward_tokens += len(ids)
        logits = self.model.forward(ids_t, meta, self.cache, rows_t)
        return logits, rows
