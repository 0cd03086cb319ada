"""Factories and a driver loop shared by the scheduler tests."""

from __future__ import annotations

from pdserve.scheduler import EngineConfig, Planner, Request, SamplingLimits, StepResult


def config(**kw) -> EngineConfig:
    base = dict(page_size=4, total_pages=256, max_scheduled_tokens=64, max_batch_size=64,
                safe_steps=4096)
    base.update(kw)
    return EngineConfig(**base)


def req(rid: str, prompt, max_new: int | None = 4, strict: bool = False) -> Request:
    if isinstance(prompt, int):
        prompt = [hash((rid, i)) % 1000 + 1 for i in range(prompt)]
    return Request(rid, prompt, SamplingLimits(max_new_tokens=max_new, strict=strict))


def result_for(plan, token: int = 1, stopped=(), ack: bool = True) -> StepResult:
    """What an executor that finishes everything within the round reports
    (disk reads are acked in their round whatever `ack` says: they hit)."""
    return StepResult([token] * len(plan.decodes),
                      [token if op.completes else None for op in plan.prefills],
                      set(stopped),
                      [s.id for s in plan.stores] if ack else [],
                      [ld.id for ld in plan.loads] if ack else [],
                      [d.id for d in plan.disk_loads])


def step(p: Planner, token: int = 1):
    """One round: build, feed one token per decode and completing prefill,
    check the invariants. Returns (plan, finished)."""
    plan = p.build()
    done = p.apply(plan, result_for(plan, token))
    p.check_invariants()
    return plan, done


def run_to_completion(p: Planner, max_rounds: int = 100_000) -> list:
    """Drive until nothing is live; fails on an empty round with work left."""
    finished = []
    for _ in range(max_rounds):
        if not p.has_work():
            return finished
        plan, done = step(p)
        assert not plan.is_empty(), f"stalled with {len(p.requests)} live requests"
        finished.extend(done)
    raise AssertionError("did not finish")


def save_with_noisy_norms(model, d):
    """Perturb a random transformers model's norm weights (so a mix-up
    between them, or a wrong state, shows), then save_pretrained it to `d`.
    Returns (model, d)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(d, safe_serialization=True)
    return model, d
