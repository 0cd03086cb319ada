"""`pdserve.LLM`: the offline API, one fused engine in-process.

    from pdserve import LLM, SamplingParams
    llm = LLM()                                   # the embedded tiny model
    with LLM("deploy/local-fused.yaml") as llm:   # or a config YAML; closed at the end
        out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)

An LLM holds what it started (a tensor-parallel model's other ranks, in
processes of their own, and this process's torch.distributed group; the
forward thread; the disk tier's writer) until `close()`, the end of its
`with` block, or its collection, whichever comes first: `del llm` and a
new LLM works, tensor-parallel included.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import weakref
from dataclasses import dataclass

from pdserve.config import ServeConfig, engine_for_model, load_config
from pdserve.text.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.tp.leader import load_engine_model
from pdserve.engine.executor.torch_executor import TorchExecutor
from pdserve.scheduler.capacity import ingest_error
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.request import Request, SamplingLimits


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    text: str
    token_ids: list
    finish_reason: str
    logprobs: list | None = None       # a sampling.Logprob per token, if asked for
    cached_tokens: int = 0             # prompt tokens found cached (device, host or disk)


class LLM:
    def __init__(self, config=None, *, dtype: str | None = None, device: str | None = None,
                 attention: str | None = None, **engine_overrides):
        """`dtype`, `device` and `attention` override the config's model.dtype,
        model.device and model.attention (all 'auto' by default; a device of
        auto is cpu)."""
        if config is None:
            cfg = ServeConfig()
        elif isinstance(config, ServeConfig):
            cfg = config
        elif isinstance(config, dict):
            cfg = ServeConfig.from_dict(config)
        else:
            cfg = load_config(config)
        engine = cfg.engine
        if engine_overrides:
            engine = dataclasses.replace(engine, **engine_overrides)
        on = cfg.model.device_for(device)
        if engine.tensor_parallel_size > 1:
            _free_process_group()
        # tensor_parallel_size > 1: rank 0 here, the other ranks in processes it starts
        self.model, self.tokenizer = load_engine_model(
            cfg.model.path, cfg.model.preset, dtype=dtype or cfg.model.dtype,
            device=on, attention=attention or cfg.model.attention,
            tensor_parallel_size=engine.tensor_parallel_size,
            timeout_s=engine.tensor_parallel_timeout_s, check=engine.tensor_parallel_check,
            quantization=cfg.model.quantization, expert_parallel=cfg.model.expert_parallel)
        self._held = _Held(self.model)
        # run on close(), or when the LLM is collected: never twice (a later
        # LLM's process group is not this one's to destroy)
        self._finalizer = weakref.finalize(self, self._held.close)
        try:
            self._start(cfg, engine, engine_overrides, on)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: ServeConfig, engine, engine_overrides: dict, on: str) -> None:
        """Everything after the model's load: the engine that drives it."""
        if on == "cpu":
            from pdserve.cluster.cpu_threads import share_kernel_cores
            share_kernel_cores(engine.cpu_threads)
        engine = engine_for_model(engine, cfg.engine_overrides | set(engine_overrides),
                                  self.model.cfg.max_position)
        self.engine_config = engine
        self.adapters = None
        if cfg.lora.enabled:
            from pdserve.engine.lora.adapters import EngineAdapters
            self.adapters = EngineAdapters(self.model, "fused-0", cfg.lora.adapters,
                                           cfg.lora.max_loras, cfg.lora.max_lora_rank,
                                           cfg.model.served_name, cfg.lora.cpu_loras,
                                           cfg.lora.pinned)
        self.executor = TorchExecutor(self.model, self.tokenizer, engine, adapters=self.adapters)
        lora_slots = cfg.lora.max_loras if cfg.lora.enabled else 0
        self.engine = Engine("fused-0", Planner(engine, groups=self.executor.groups,
                                                lora_slots=lora_slots),
                             self.executor, forget_finished=False)
        if self.adapters is not None:
            self.adapters.bind(self.engine.planner.lora)
        self._held.executor = self.executor
        self._next = 0

    def close(self) -> None:
        """Stop what the LLM started: the forward thread, the disk tier's
        writer, a tensor-parallel model's other ranks and its process group.
        Once is enough: a second close, or the collection after it, does
        nothing."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.model.cfg.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the model's vocabulary "
                             f"[0, {vocab}); pass text or valid ids")
        return None, ids

    def _adapter_ids(self, adapter, n: int) -> list[int]:
        """Each prompt's adapter load id: `adapter` is None (the base model),
        one name for every prompt, or one (or None) per prompt."""
        names = adapter if isinstance(adapter, list) else [adapter] * n
        if len(names) != n:
            raise ValueError(f"{len(names)} adapters for {n} prompts; give one, or one per "
                             "prompt")
        if any(names) and self.adapters is None:
            raise ValueError(f"adapter {next(a for a in names if a)!r} asked for, but this LLM "
                             "serves no LoRA adapters; give its config lora: {adapters: "
                             "{name: path}}")
        try:
            return [self.adapters.registry.resolve(a) if a else 0  # type: ignore[union-attr]
                    for a in names]
        except KeyError as e:
            raise ValueError(e.args[0]) from None

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, adapter=None):
        """`adapter`: the LoRA adapter's name (the config's lora.adapters), for
        every prompt or a list with one per prompt (None: the base model)."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; "
                             "give one, or one per prompt")
        encoded = [self._encode(p) for p in prompts]
        adapter_ids = self._adapter_ids(adapter, len(prompts))
        # refuse the whole batch before anything runs: nothing half-done
        for i, ((_, ids), sp) in enumerate(zip(encoded, params)):
            err = ingest_error(self.engine_config, len(ids), sp.max_tokens,
                               self.engine.planner.coord.full is not None)
            if err:
                raise ValueError(f"prompt {i}: {err}")
            bad = [t for t, _ in sp.logit_bias if t >= self.model.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: logit_bias names token id {bad[0]}, outside the "
                                 f"model's vocabulary [0, {self.model.cfg.vocab_size})")
        reqs = [self.add_request(ids, sp, aid)
                for (_, ids), sp, aid in zip(encoded, params, adapter_ids)]
        self._run(len(reqs), use_tqdm)
        return [self._output(r, text, sp) for r, (text, _), sp in zip(reqs, encoded, params)]

    def add_request(self, ids: list[int], sp: SamplingParams, adapter_id: int = 0) -> Request:
        """Put one prompt of checked token ids into the engine, and return
        its request: the caller steps `self.engine` until it ends, then
        calls `self.executor.forget` on its id (`generate` does all this;
        sim/local_engine.py paces arrivals itself). A prompt the engine
        cannot take is a ValueError that says why."""
        err = ingest_error(self.engine_config, len(ids), sp.max_tokens,
                           self.engine.planner.coord.full is not None)
        if err:
            raise ValueError(err)
        rid = f"llm-{self._next}"
        self._next += 1
        req = Request(rid, ids, SamplingLimits(max_new_tokens=sp.max_tokens, strict=sp.strict),
                      adapter=adapter_id)
        self.executor.register(rid, sp, fallback_seed=self._next, prompt=ids)
        self.engine.submit(req)
        return req

    def _run(self, n: int, use_tqdm: bool) -> None:
        from tqdm import tqdm

        bar = tqdm(total=n, disable=not use_tqdm or n < 2, unit="req", file=sys.stderr,
                   desc="generate")
        while self.engine.has_work():
            out = self.engine.step()
            if out is None and self.executor.grammars.waiting():
                self.executor.grammars.wait_any(0.05)   # a grammar compiles: nothing to run yet
                continue
            if out is None:
                raise RuntimeError("the engine built an empty round with work left; "
                                   f"stalls: {self.engine.planner.stalls}")
            bar.update(len(out.finished))
            for req in out.failed:
                self.executor.forget(req.id)
            if out.failed:
                raise RuntimeError(f"{out.error}; {len(out.failed)} requests failed")
        bar.close()

    def _output(self, req, prompt_text, sp: SamplingParams) -> RequestOutput:
        t = self.executor.tracked[req.id]
        self.executor.forget(req.id)        # its sampling state, and any proposer's
        # a stop string, even on the last allowed token, ends with "stop"
        reason = "stop" if t.detok.stopped else req.finish_reason  # type: ignore[union-attr]
        return RequestOutput(req.id, prompt_text, list(req.prompt.tokens), t.detok.text,  # type: ignore[union-attr]
                             list(req.output), reason,
                             t.logprobs if sp.logprobs is not None else None, sum(req.cached))


class _Held:
    """What an LLM stops when it closes: its model until its executor, which
    owns the model, exists. A finalizer's target must not hold the LLM
    itself, or the LLM would never be collected."""

    def __init__(self, model):
        self.model = model
        self.executor = None

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            return
        close = getattr(self.model, "close", None)
        if close is not None:               # a tensor-parallel model's worker ranks
            close()


def _free_process_group() -> None:
    """A tensor-parallel LLM's rank 0 joins torch.distributed's default
    process group, of which a process has one. A former LLM that is
    unreachable but not yet collected (in a reference cycle) still holds it:
    collected here, its finalizer leaves the group. One still reachable is
    an error that says what to do."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    gc.collect()
    if dist.is_initialized():
        raise ValueError("torch.distributed's default process group is in use in this "
                         "process (another tensor-parallel LLM still open, or the program's "
                         "own), and a tensor-parallel LLM's rank 0 needs it: close() the "
                         "other LLM, leave its `with` block or drop every reference to it "
                         "first")
