"""`pdserve bench spec --draft`: the draft-model proposer's acceptance, as a
correctness figure.

No checkpoint smaller than the target and sharing its vocabulary ships
with pdserve, so the draft cases are the two whose acceptance is known in
advance: the target drafting for itself (every candidate accepted: mean
acceptance length k + 1) and a random checkpoint with the target's
vocabulary (written here, loaded through `draft_model: {path: ...}` as a
user's would be; nearly every candidate rejected: about 1). Both run the
whole path (the draft's K/V in the target's pages, keep-up after a verify, candidates
into verify rows) and their greedy outputs must equal speculation off.
Their tokens/s says what drafting costs on this host, not what a real
draft would gain.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from pdserve.benchmarks.common.tables import median_range
from pdserve.benchmarks.spec.workload import Case, prompts_for, run_cases


def write_random_checkpoint(d: Path, vocab: int, bos: int | None, eos: tuple,
                            seed: int = 1, noise_of: dict | None = None,
                            noise: float = 0.0) -> Path:
    """A small Llama checkpoint (the tiny preset's shape) with `vocab`
    tokens, saved as Hugging Face saves one: random weights, or `noise_of`'s
    (a weights dict of that shape) plus Gaussian noise of `noise` times each
    matrix's spread."""
    import torch
    from safetensors.torch import save_file

    from pdserve.kernels.models.model import random_weights
    from pdserve.kernels.models.model_config import tiny_config

    c = dataclasses.replace(tiny_config(), vocab_size=vocab)
    g = torch.Generator().manual_seed(seed)
    base = noise_of if noise_of is not None else random_weights(c, seed)
    w = {k: (v + torch.randn(v.shape, generator=g) * noise * v.std()).contiguous()
         if v.ndim == 2 and noise else v.contiguous() for k, v in base.items()}
    d.mkdir(parents=True, exist_ok=True)
    save_file(w, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position, "tie_word_embeddings": False,
        "bos_token_id": bos, "eos_token_id": list(eos)}))
    return d


def run_draft(args, model, tok, sp, levels: list) -> None:
    k = 3
    with tempfile.TemporaryDirectory() as tmp:
        rnd = write_random_checkpoint(Path(tmp) / "random-draft", model.cfg.vocab_size,
                                      model.cfg.bos_token_id, model.cfg.eos_token_ids)
        cases = [Case("off", None),
                 Case(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                       "gate": False}),
                 Case(f"draft = target k={k}", {"method": "draft", "num_speculative_tokens": k,
                                                "draft_model": {"preset": args.preset},
                                                "gate": False}),
                 Case(f"random draft k={k}", {"method": "draft", "num_speculative_tokens": k,
                                              "draft_model": {"path": str(rnd)},
                                              "gate": False})]
        for c in levels:
            prompts = prompts_for(tok, args.requests * c)
            engines, got = run_cases(model, tok, cases, prompts, sp, c, args.repeats)
            _table(c, prompts, got, cases, args.repeats, engines)


def _table(c: int, prompts, got: dict, cases, repeats: int, engines: dict) -> None:
    med = statistics.median
    ref = got["off"][0].outputs
    off = med(m.tokens_per_s for m in got["off"])
    print(f"\n## draft model, concurrency {c}: {len(prompts)} requests, {repeats} repeats "
          "(acceptance is a correctness figure: draft = target must accept every candidate "
          "carried, k + 1 a verify but where a request's last tokens leave room for fewer; "
          "a random draft about 1)\n")
    print("| case | mean acceptance length | candidates accepted | tokens/s (min-max) | vs off | "
          "CPU ms/token | rounds/request | outputs as off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in cases:
        ms = got[case.name]
        tps = [m.tokens_per_s for m in ms]
        acc = med(m.acceptance for m in ms)
        same = sum(o == r for m in ms for o, r in zip(m.outputs, ref))
        spec = engines[case.name].executor.spec
        kept = f"{spec.counts.accepted_tokens}/{spec.counts.draft_tokens}" if spec else "-"
        print(f"| {case.name} | {f'{acc:.2f}' if acc else '-'} | {kept} | {median_range(tps)} "
              f"| {med(tps) / off:.2f}x | "
              f"{med(m.cpu_ms_per_token for m in ms):.0f} | "
              f"{med(m.rounds_per_request for m in ms):.1f} | {same}/{len(ms) * len(ref)} |",
              flush=True)
