"""The torch executor: carries a plan out on a real model.

Order within a round is the spec's stream order: host stores first (the
retraction snapshots among them read pages the plan has already granted to
someone else), then disk reads into host pages, then loads back from host,
then the forward. With a disk tier (engine/disk/tier.py), a pinned store of
the full history is written through to disk, and a request whose disk read
missed samples nothing this round (the planner retracts it). Fresh pages are
not zeroed: attention reads only positions a request has written. Every copy
finishes within the round (on a GPU: queued on one stream, then one sync),
so every store and load is acked in the result.

Each cache group (the model's `cache_groups()`) has its own device pool and
host pool, and each request its own block table per group. A round's
forward gets one BatchMeta per group: a sliding group's sequences read from
their window's first page on (slots below are HOLE), and replay rows write
their K/V only into replayable groups (spec §1.3). A model with state
layers (Qwen3.5) has a snapshot-state group last: its pools are
StateCaches, and each sequence's SeqState names the slots its table gives
the state it starts from, the state it ends with and the checkpoint
between (spec §1.2).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass

import torch

from pdserve.kernels.capture import CaptureMode, DecodeCapture, choose_capture
from pdserve.text.detokenize import Detokenizer
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.spec.rejection import verify
from pdserve.kernels.sampling import apply_grammar_masks, sample
from pdserve.text.sampling_params import Logprob, SamplingParams
from pdserve.kernels.models.state_cache import StateCache
from pdserve.engine.disk.groups import StateFiles, window_files
from pdserve.engine.disk.model_match import check_model_served
from pdserve.engine.disk.tier import DiskTier
from pdserve.engine.grammar import RequestGrammars
from pdserve.engine.executor.round_stage import StagedRound, stage_round
from pdserve.engine.spec.draft import load_draft
from pdserve.engine.spec.round import (SpecRound, check_speculation, draft_ask, round_rows,
                                      keep_up_asks, speculates_now)
from pdserve.engine.spec.speculation import Speculation
from pdserve.engine.executor.tier_copies import copy_between_tiers
from pdserve.engine.executor.tracked import Tracked, penalty_history
from pdserve.scheduler.cache.groups import StateBlocks
from pdserve.scheduler.capacity import group_pages
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.plan import Plan, StepResult

log = logging.getLogger("pdserve.kernels")


@dataclass
class Launched:
    """A round `TorchExecutor.launch` started: the copies' acks so far, the
    rows that sample, and the forward thread's future (None: no forward)."""
    plan: Plan
    result: StepResult
    rows: list
    future: cf.Future | None = None
    spec: SpecRound | None = None   # its verify rows, with speculation
    started: float = 0.0            # perf_counter at launch (the speculation gate's clock)
    cpu_started: float = 0.0        # process_time at launch (the gate's cost)
    keep_up: dict | None = None     # a draft model's: request id -> its RoundRows


class TorchExecutor:
    def __init__(self, model, tokenizer, cfg: EngineConfig, detokenize: bool = True,
                 groups=None, adapters=None, disk: DiskTier | None = None):
        """`detokenize=False`: tokens only; stop strings are then found by
        whoever makes the text (engine/outputs.py). `groups`: the planner's
        CacheGroupSpecs, by default the model's `cache_groups()` (sliding
        groups replayable when engine.sliding_replay is set) and its state
        group (`state_group`, checkpointed every engine.state_block tokens);
        they must lay out the model's layers as the model does (replayable
        and the state block may differ). `adapters`: the engine's LoRA
        adapters (engine/lora/adapters.py), each request's rows run under its
        `Request.adapter`'s slot; None: no adapters.
        `disk`: the disk tier (default:
        engine.disk_cache's file tier, opened here; a path that cannot be
        written raises DiskStoreError)."""
        self.model = model
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.page_size = cfg.page_size
        if groups is None:
            state = model.cfg.state_group(cfg.state_block)
            groups = model.cache_groups(replayable=cfg.sliding_replay) + ([state] if state else [])
        self.groups = list(groups)
        _check_groups(self.groups, model)
        # the state group (last, if any) keeps slots in a StateCache, the others pages
        self.state = len(self.groups) - 1 if self.groups[-1].state else None
        self.kv = [g for g in range(len(self.groups)) if g != self.state]
        sizes = group_pages(cfg, self.groups)
        capture, capture_why = choose_capture(cfg.capture, model)
        # a captured step's padding rows write into a page the planner never grants
        spare = 0 if capture is CaptureMode.OFF else 1
        # a draft model's K/V share the target's pages (engine/spec/draft.py);
        # its candidates past a block table go to scratch pages after the pool
        if cfg.speculative is not None:
            check_speculation(model, self.groups)
        draft = load_draft(cfg, model, [self.groups[g] for g in self.kv])
        companions = list(draft.layout.shapes) if draft is not None else None
        self.caches = model.new_caches(
            [sizes[g] + (draft.scratch_pages(i) if draft else 0) + spare
             for i, g in enumerate(self.kv)], cfg.page_size, companions)
        if self.state is not None:
            self.caches.append(model.new_state_cache(sizes[self.state]))
        self.hosts = self._host_pools(cfg, sizes, companions)
        # the state group's entry arithmetic, as the planner's coordinator does it
        self._blocks = StateBlocks(self.groups[self.state], cfg.page_size) \
            if self.state is not None else None
        # the first group's pools, for callers that know one group
        self.cache = self.caches[0]
        self.host = self.hosts[0] if self.hosts else None
        self.capture = self._captured(cfg, capture, capture_why)
        self.eos = set(model.cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos.add(tokenizer.eos_token_id)
        self._eos_ids = frozenset(self.eos)
        self.tracked: dict[str, Tracked] = {}
        # structured outputs: grammars compiled off the loop, a matcher per request
        self.grammars = RequestGrammars(tokenizer, model.cfg.vocab_size,
                                        cfg.grammar_compile_timeout_s)
        self.forward_tokens = 0
        self.fed_on_device = 0      # decode inputs taken from the last round's sampled tensor
        # (that tensor, request id -> row), after a launched round
        self._sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._worker: cf.ThreadPoolExecutor | None = None   # the forward thread, from the first launch
        if disk is None and cfg.disk_cache is not None:
            check_model_served(cfg.disk_cache, model.cfg, cfg.state_block, cfg.sliding_replay,
                               cfg.state_checkpoints)
            disk = DiskTier.open(cfg.disk_cache, model, cfg.page_size, self.caches[0].layout(),
                                 self.state_files(), window_files(self.groups, self.caches))
        self.disk = disk
        self._disk_missed: set[str] = set()     # requests whose disk read missed this round
        # speculative decoding (engine/spec/speculation.py), engine.speculative's
        self.spec: Speculation | None = None
        if cfg.speculative is not None:
            proposer = draft.proposer(self.caches, [sizes[g] for g in self.kv]) \
                if draft is not None else None
            self.spec = Speculation(cfg.speculative, proposer=proposer)

    def _host_pools(self, cfg: EngineConfig, sizes: list[int],
                    companions) -> list[KVCache | StateCache]:
        """The host (L2) tier's pools, one per group, or none without
        engine.host_pages."""
        if not cfg.host_pages:
            return []
        model, c = self.model, self.model.cfg
        pin = model.device.type == "cuda"
        # page-locked beside a GPU (exactly its size, not torch's power of
        # two): stores and loads are then DMA straight between the pools
        hosts: list[KVCache | StateCache] = [
            KVCache(len(self.groups[g].layers), cfg.host_pages, cfg.page_size,
                    c.num_kv_heads, c.head_dim, model.dtype, "cpu", pin_memory=pin,
                    companion=companions[g] if companions else None, parts=c.kv_parts)
            for g in self.kv]
        if self.state is not None:
            # the state group's host tier: engine.host_state_slots (0: as on the device)
            hosts.append(StateCache.for_model(c, cfg.host_state_slots or sizes[self.state],
                                              model.dtype, "cpu", pin_memory=pin))
        return hosts

    def _captured(self, cfg: EngineConfig, mode: CaptureMode, why: str) -> DecodeCapture | None:
        """The decode step captured at load, or None (logged: why not)."""
        if mode is CaptureMode.OFF:
            log.info("decode step not captured: %s", why)
            return None
        capture = DecodeCapture(
            self.model, self.caches[:len(self.kv)], mode, cfg.max_batch_size,
            -(-cfg.max_context_tokens // cfg.page_size),
            [self.groups[g].window if self.groups[g].sliding else None for g in self.kv])
        capture.capture()
        return capture

    # ---- per-request sampling state ---------------------------------------
    def register(self, req_id: str, params: SamplingParams, fallback_seed: int,
                 prompt=(), prior_output: int = 0) -> None:
        """`prior_output`: how many of the prompt's last tokens the request
        generated before it was resubmitted; penalties count them as output,
        and a seeded request draws on where it left off."""
        detok = Detokenizer(self.tokenizer, prompt, params.stop,
                            params.include_stop_str_in_output,
                            params.skip_special_tokens) if self.detokenize else None
        self.tracked[req_id] = Tracked(params, fallback_seed, detok, prior=prior_output)
        if params.constraint is not None:       # it waits for this (Engine.step)
            self.grammars.start(req_id, params.constraint)

    def params(self, req_id: str) -> SamplingParams:
        return self.tracked[req_id].params

    def prior_output(self, req_id: str) -> int:
        return self.tracked[req_id].prior

    def forget(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)
        self.grammars.forget(req_id)
        if self.spec is not None:
            self.spec.forget(req_id)

    def on_token(self, req, token: int, logprob: Logprob | None = None) -> bool:
        """Take `token`, sampled next for `req`: extend its text and logprobs;
        True if it ends the request (EOS, a stop id, or, when this executor
        detokenizes, a stop string). Every token of a request passes here
        once, in order."""
        t = self.tracked[req.id]
        if t.ended:
            return True             # sampled ahead after its end: the planner drops it
        sp = t.params
        t.tokens += 1
        if logprob is not None:
            t.logprobs.append(logprob)
        early = t.tokens < sp.min_tokens
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos):
            if not early:
                t.ended = True
                return True         # a stop token's text is not part of the answer
        # a complete grammar ends the request, its last token part of the answer
        done = sp.constraint is not None and self.grammars.accept(req.id, token)
        t.grammar_done = done
        if t.detok is None:
            t.ended = done
            return done
        stopped = t.detok.push(token, check_stop=not early)
        t.detok.ready()             # hand the text on as it comes: no string grows per token
        t.ended = stopped or done
        return t.ended

    # ---- one round ----------------------------------------------------------
    def run(self, plan: Plan) -> StepResult:
        self._sampled = None        # a round run in place feeds nothing from the device
        t0, c0 = time.perf_counter(), time.process_time()
        result, self._disk_missed = copy_between_tiers(self, plan)
        if not (plan.prefills or plan.decodes):
            return result
        staged, rows, spec = self._stage(plan)
        masks = self._fill_masks(rows, spec)    # on the mask thread, beside the forward
        keep_up = self._keep_up(plan, copy=False)
        logits = self._compute(staged)
        if masks is not None:
            m = masks.result()
            logits = apply_grammar_masks(logits, m.rows, m.bits)
        n = len(rows)
        tokens, logprobs = sample(logits[:n], *self._sample_inputs(rows)) if rows else ([], [])
        if spec is not None:
            spec.tokens = verify(logits[n:], spec.rows)
        self._land(plan, rows, tokens, logprobs, result, spec, keep_up)
        if self.spec is not None:
            self.spec.round_done(plan, result, time.perf_counter() - t0,
                                 time.process_time() - c0)
        return result

    # ---- a round that runs ahead (engine.overlap) ---------------------------------
    def launch(self, plan: Plan) -> Launched:
        """Start `plan`: its copies now, its forward and sampling on the
        forward thread (on a GPU its kernels queue on the device's stream,
        in order behind the copies, and the host goes on). A decode whose
        request was sampled by the forward launched last takes that token
        from the device tensor it was sampled into, not from the host list
        (which that round's apply may not have filled yet). `wait` lands it."""
        result, self._disk_missed = copy_between_tiers(self, plan)
        if not (plan.prefills or plan.decodes):
            self._sampled = None
            return Launched(plan, result, [], None)
        staged, rows, spec = self._stage(plan, feed=self._sampled, own_tables=True)
        inputs = self._sample_inputs(rows) if rows else None
        if self._worker is None:
            self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="forward")
        self._sampled = None        # until this round's tokens exist
        # the masks see every token before this round's: the last round landed
        # (wait, then apply) before this launch
        masks = self._fill_masks(rows, spec)
        fut = self._worker.submit(self._forward_and_sample, staged, inputs, spec, len(rows),
                                  masks)
        return Launched(plan, result, rows, fut, spec, time.perf_counter(), time.process_time(),
                        self._keep_up(plan, copy=True))

    def wait(self, launched: Launched) -> StepResult:
        """The launched round's result, once its forward and sampling are done."""
        result, rows = launched.result, launched.rows
        if launched.future is None:
            return result
        tokens, logprobs, on_device = launched.future.result()
        self._sampled = (on_device, {r.id: i for i, r in enumerate(rows)}) if rows else None
        self._land(launched.plan, rows, tokens, logprobs, result, launched.spec, launched.keep_up)
        if self.spec is not None:
            self.spec.round_done(launched.plan, result, time.perf_counter() - launched.started,
                                 time.process_time() - launched.cpu_started)
        return result

    def _forward_and_sample(self, staged, inputs, spec: SpecRound | None, n: int,
                            masks: cf.Future | None = None):
        """The forward thread's part: nothing here reads planner state."""
        logits = self._compute(staged)
        if masks is not None:
            m = masks.result()
            logits = apply_grammar_masks(logits, m.rows, m.bits)
        if spec is not None:
            spec.tokens = verify(logits[n:], spec.rows)
        if inputs is None:
            return [], [], None
        keep: list = []
        params, steps, seeds, stop_ids, histories, earlier = inputs
        tokens, logprobs = sample(logits[:n], params, steps, seeds, stop_ids, histories,
                                  earlier, keep=keep)
        return tokens, logprobs, keep[0]

    def close(self) -> None:
        """Stop the forward thread (if a round ever ran ahead), the disk
        tier's worker, once its queued writes are done, and a
        tensor-parallel model's other ranks."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self.grammars.close()
        if self.disk is not None:
            self.disk.close()
        close = getattr(self.model, "close", None)
        if close is not None:               # a tensor-parallel model's worker ranks
            close()

    # ---- the parts of a round ---------------------------------------------------------
    def state_files(self) -> StateFiles | None:
        """What the disk tier needs of a state group (None: none)."""
        if self.state is None:
            return None
        grp = self.groups[self.state]
        return StateFiles(self.state, grp.block_tokens(self.page_size) // self.page_size,
                          self.caches[self.state].layout())

    def data_is_cuda(self) -> bool:
        return self.cache.data.is_cuda

    def _sample_inputs(self, rows) -> tuple:
        """`sample`'s arguments after the logits, read from the requests now."""
        tracked = [self.tracked[r.id] for r in rows]
        histories = [penalty_history(r, t) if t.params.penalizes else None
                     for r, t in zip(rows, tracked)] \
            if any(t.params.penalizes for t in tracked) else None
        earlier = [t.prior for t in tracked] if any(t.prior for t in tracked) else None
        return ([t.params for t in tracked], [len(r.output) for r in rows],
                [t.seed for t in tracked], self._eos_ids, histories, earlier)

    def _fill_masks(self, rows, spec: SpecRound | None) -> cf.Future | None:
        """The round's grammar masks, started on the mask thread (None: no
        row of the round is constrained)."""
        return self.grammars.submit_fill(rows, spec.verifies if spec is not None else [],
                                         len(rows))

    def _keep_up(self, plan: Plan, copy: bool) -> dict | None:
        """Where each request's rows begin, for a proposer keeping K/V."""
        if self.spec is None or not self.spec.proposer.keeps_kv:
            return None
        return round_rows(plan, self.kv, copy)

    def _land(self, plan: Plan, rows, tokens, logprobs, result: StepResult,
              spec: SpecRound | None = None, keep_up: dict | None = None) -> None:
        it = iter(zip(rows, tokens, logprobs))
        sampled = []                    # (request, its new tokens) for the proposer
        landed: dict[str, list] = {}    # request id -> the tokens it took this round
        for op in plan.prefills:
            if op.completes:
                req, tok, lp = next(it)
                result.prefill_tokens.append(tok)
                if req.id in self._disk_missed:
                    continue            # computed on unfilled pages: the planner drops it
                landed[req.id] = [tok]
                if self.on_token(req, tok, lp):
                    result.stopped.add(req)
                else:
                    sampled.append((req, [tok]))
            else:
                result.prefill_tokens.append(None)
        verified = spec.by_request() if spec is not None else {}
        for req in plan.decodes:
            got = verified.get(req.id)
            if got is None:
                _, tok, lp = next(it)
                new = [tok]
                ended = self.on_token(req, tok, lp)
            else:
                new, ended = self._take_verified(req, got, spec)
                if len(new) > 1:
                    result.decode_more[req.id] = new[1:]
            result.decode_tokens.append(new[0])
            landed[req.id] = new
            if ended:
                result.stopped.add(req)
            else:
                sampled.append((req, new))
        if self.spec is None:
            return
        asks = [draft_ask(req, new, self.spec.k, self.tracked[req.id]) for req, new in sampled
                if speculates_now(self.tracked[req.id], req, new)]
        if keep_up is not None:         # a draft model: its K/V follow every row
            asks = keep_up_asks(plan, landed, asks, keep_up, self.spec.proposer.target_groups,
                                self._disk_missed)
        if asks:
            result.drafts = self.spec.propose(asks)
            # only the candidates a request's grammar allows are verified
            result.drafts = {rid: d for rid, d in (
                (rid, self.grammars.valid_drafts(rid, d)) for rid, d in result.drafts.items())
                if d}

    def _take_verified(self, req, got, spec) -> tuple[list, bool]:
        """A verify's tokens, each taken as a decode's would be, up to the
        first that ends the request; counted for the acceptance metrics."""
        assert self.spec is not None
        carried = len(spec.drafts_of(req.id))
        self.spec.counts.verified(carried, len(got) - 1)
        for i, tok in enumerate(got):
            if self.on_token(req, tok, None):
                return got[:i + 1], True
        return got, False

    def forward(self, plan: Plan):
        """The round's forward: (logits of the rows that sample, float32, and
        their requests, in order: completing prefills, then decodes; a
        verify row's 1 + k positions after them)."""
        staged, rows, _ = self._stage(plan)
        return self._compute(staged), rows

    def _stage(self, plan: Plan, feed=None, own_tables: bool = False):
        """The round's StagedRound, the requests of its sampling rows and its
        SpecRound (engine/executor/round_stage.py). `feed`: (the last launched round's
        sampled tokens on the device, request id -> row); `own_tables`:
        copy the block tables, which the next round's build may change
        while this forward runs."""
        staged, rows, spec = stage_round(self, plan, feed, own_tables)
        self.forward_tokens += int(staged.ids.numel())
        self.fed_on_device += staged.fed_rows
        return staged, rows, spec

    def _compute(self, staged: StagedRound):
        ids_t, metas = staged.ids, staged.metas
        if staged.fed is not None:
            f = staged.fed
            ids_t.index_copy_(0, f.to, f.tokens.index_select(0, f.frm).to(ids_t.dtype))
        caches = [self.caches[g] for g in self.kv]
        if staged.lora is not None:
            # on the forward thread: after the last forward
            for slot, adapter in staged.lora.needs.items():
                self.adapters.ensure(slot, adapter)
            return self.model.forward(ids_t, metas, caches, staged.rows, lora=staged.lora.rnd)
        if self.capture is not None and staged.states is None and self.capture.covers(metas):
            logits = self.capture.run(ids_t, metas)
            if logits is not None:
                return logits
        if staged.states is None:
            return self.model.forward(ids_t, metas, caches, staged.rows)
        return self.model.forward(ids_t, metas, caches, staged.rows, states=staged.states)

    # ---- what P -> D transfers move ---------------------------------------------
    def _state_tensors(self) -> list:
        """The state group's tensors that hold anything (LFM2 keeps no
        recurrent state: that tensor has no elements and does not travel)."""
        st = self.caches[self.state]
        return [t for t in (st.conv, st.recurrent) if t.numel()]

    def transfer_pools(self) -> list:
        """The tensors a transport registers, one row per page or slot:
        each page group's pool, then the state group's conv and recurrent."""
        out = [self.caches[g].data for g in self.kv]
        if self.state is not None:
            out += self._state_tensors()
        return out

    def transfer_lists(self, per_group) -> list:
        """Per-group page (slot) lists as `transfer_pools` rows: a state
        slot moves as its conv row and its recurrent row."""
        out = [per_group[g] for g in self.kv]
        if self.state is not None:
            out += [per_group[self.state]] * len(self._state_tensors())
        return out

    def group_bytes(self) -> list[int]:
        """Bytes of one page (a state group: one slot) of each group."""
        return [c.slot_bytes() if g == self.state else c.data[0].nbytes
                for g, c in enumerate(self.caches)]


def _check_groups(groups, model) -> None:
    """The planner's groups must lay out the model's layers as the model does."""
    def shape(gs):
        return [(g.retention, g.window, tuple(g.layers)) for g in gs]

    state = model.cfg.state_group()
    want = model.cache_groups() + ([state] if state else [])
    if shape(groups) != shape(want):
        raise ValueError(f"cache groups {shape(groups)} (retention, window, layers) are not "
                         f"the model's {shape(want)}; build them with model.cache_groups() "
                         "and model.cfg.state_group()")
