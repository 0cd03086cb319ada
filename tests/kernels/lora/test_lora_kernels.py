"""Batched LoRA in the Llama decoder: each row under its own adapter equals
the merged weights, equals transformers + peft, and a mixed batch equals
each row alone."""

import pytest
import torch

from support.lora import tiny_adapter, tiny_llama
from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.models.loader import load_model
from pdserve.kernels.lora.batched import LoraRound
from pdserve.kernels.lora.adapter import AdapterError, load_adapter, merged
from support.lora import PROMPTS, greedy

PAGE = 4


def batch(model, prompts):
    """One prefill round of `prompts` on fresh pages: (ids, meta, cache, last rows)."""
    ids, slots, seqs, last, page = [], [], [], [], 0
    for p in prompts:
        n = len(p)
        table = list(range(page, page + -(-n // PAGE)))
        page += len(table)
        seqs.append(SeqMeta(len(ids), n, n, table))
        slots += [table[i // PAGE] * PAGE + i % PAGE for i in range(n)]
        ids += p
        last.append(len(ids) - 1)
    pos = torch.tensor([i for p in prompts for i in range(len(p))])
    meta = BatchMeta(seqs, torch.tensor(slots), pos)
    return torch.tensor(ids), meta, model.new_cache(page, PAGE), torch.tensor(last)


def logits(model, prompts, adapters=None):
    """Last-token logits of each prompt, `adapters[i]` the slot of prompt i (-1 base)."""
    ids, meta, cache, last = batch(model, prompts)
    rnd = None
    if adapters is not None:
        rnd = LoraRound.of(model.lora, [s for p, s in zip(prompts, adapters) for _ in p])
    return model.forward(ids, meta, cache, last, lora=rnd)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    hf = tiny_llama(d / "base")
    a = tiny_adapter(d / "a", seed=1)
    b = tiny_adapter(d / "b", seed=2, rank=8, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"))
    return hf, d / "base", a, b


def ours(path, weights=None):
    model, _ = load_model(str(path), None, dtype="float32", device="cpu", attention="torch")
    if weights is not None:
        from pdserve.kernels.models.model import DecoderModel
        model = DecoderModel(model.cfg, weights, torch.float32, "cpu", model.attention)
    return model


def base_weights(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_batched_lora_equals_the_merged_weights(setup):
    """Each row under its adapter's slot gives the logits of a model whose
    weights have that adapter merged in, to 1e-5 in float32."""
    _, base, a_dir, b_dir = setup
    model = ours(base)
    a, b = load_adapter(a_dir, model.cfg), load_adapter(b_dir, model.cfg)
    model.enable_lora(slots=3, max_rank=8)
    model.lora.load(0, a)
    model.lora.load(2, b)
    for adapter, slot in ((a, 0), (b, 2)):
        want = logits(ours(base, merged(base_weights(base), adapter)), PROMPTS)
        got = logits(model, PROMPTS, [slot] * len(PROMPTS))
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_a_batch_of_base_a_and_b_equals_each_request_alone(setup):
    """Rows under different adapters in one forward do not mix: base, A and
    B together give each prompt's logits of its own solo run."""
    _, base, a_dir, b_dir = setup
    model = ours(base)
    model.enable_lora(slots=2, max_rank=8)
    model.lora.load(0, load_adapter(a_dir, model.cfg))
    model.lora.load(1, load_adapter(b_dir, model.cfg))
    mixed = logits(model, PROMPTS, [-1, 0, 1])
    for i, (p, s) in enumerate(zip(PROMPTS, [-1, 0, 1])):
        alone = logits(model, [p], [s])[0]
        assert torch.allclose(mixed[i], alone, atol=1e-5, rtol=0), (mixed[i] - alone).abs().max()
    base_alone = logits(model, [PROMPTS[0]])[0]
    assert torch.allclose(mixed[0], base_alone, atol=1e-5, rtol=0)
    assert not torch.allclose(mixed[1], logits(model, [PROMPTS[1]])[0], atol=1e-3)


def test_batched_lora_equals_transformers_with_peft(setup):
    """The oracle: peft's LoRA on transformers' Llama, same checkpoint, same adapter."""
    peft = pytest.importorskip("peft")
    hf, base, a_dir, b_dir = setup
    model = ours(base)
    model.enable_lora(slots=2, max_rank=8)
    for slot, d in enumerate((a_dir, b_dir)):
        model.lora.load(slot, load_adapter(d, model.cfg))
        wrapped = peft.PeftModel.from_pretrained(hf, str(d)).eval()
        with torch.no_grad():
            want = torch.stack([wrapped(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
        hf = wrapped.unload()           # the bare base again, for the next adapter
        got = logits(model, PROMPTS, [slot] * len(PROMPTS))
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_a_slot_reloaded_serves_only_its_new_adapter(setup):
    _, base, a_dir, b_dir = setup
    model = ours(base)
    model.enable_lora(slots=1, max_rank=8)
    model.lora.load(0, load_adapter(a_dir, model.cfg))
    model.lora.load(0, load_adapter(b_dir, model.cfg))
    want = logits(ours(base, merged(base_weights(base), load_adapter(b_dir, model.cfg))), PROMPTS)
    assert torch.allclose(logits(model, PROMPTS, [0, 0, 0]), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("change, words", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"targets": ("q_proj", "embed_tokens")}, "'embed_tokens'"),
    ({"rank": 16}, "max_lora_rank=8"),
])
def test_adapters_pdserve_cannot_serve_are_refused_with_what_to_change(setup, tmp_path, change,
                                                                        words):
    _, base, _, _ = setup
    cfg = ours(base).cfg
    kw = dict(change)
    targets = kw.pop("targets", None)
    if targets is not None and "embed_tokens" in targets:
        d = tiny_adapter(tmp_path / "x", seed=3, targets=("q_proj",))
        from safetensors.torch import load_file, save_file
        t = load_file(str(d / "adapter_model.safetensors"))
        name = "base_model.model.model.layers.0.self_attn.embed_tokens.lora_A.weight"
        t[name] = torch.zeros(4, 64)
        save_file(t, str(d / "adapter_model.safetensors"))
    else:
        d = tiny_adapter(tmp_path / "x", seed=3, **kw)
    with pytest.raises(AdapterError, match=words):
        load_adapter(d, cfg, max_rank=8)


def test_an_adapter_for_another_model_is_refused(setup, tmp_path):
    from support.lora import shapes, write_adapter
    _, base, _, _ = setup
    d = write_adapter(tmp_path / "big", layers=2, dims=shapes(128, 256, 128, 64))
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter(d, ours(base).cfg)
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load_adapter(tmp_path, ours(base).cfg)


def test_an_engine_batch_of_base_a_and_b_generates_what_each_generates_alone(setup, tmp_path):
    """Through the planner and the executor (chunked, paged, a prefix
    cache shared by the base and the adapters): mixed in one batch, each
    request's greedy tokens are those of its solo run, and those of a model
    with its adapter merged."""
    from pdserve import LLM
    from safetensors.torch import save_file
    _, base, a_dir, b_dir = setup
    engine = {"page_size": 4, "total_pages": 128, "max_scheduled_tokens": 16}
    llm = LLM({"model": {"path": str(base)}, "engine": engine,
               "lora": {"adapters": {"A": str(a_dir), "B": str(b_dir)}, "max_loras": 2,
                        "max_lora_rank": 8}})
    prompt = PROMPTS[0]
    names = [None, "A", "B", "A", None, "B"]
    mixed = [o.token_ids for o in llm.generate([prompt] * 6, greedy(), use_tqdm=False,
                                               adapter=names)]
    alone = {n: llm.generate([prompt], greedy(), use_tqdm=False, adapter=n)[0].token_ids
             for n in (None, "A", "B")}
    assert mixed == [alone[n] for n in names]
    assert len({tuple(t) for t in alone.values()}) == 3       # each adapter changes the output
    for name, d in (("A", a_dir), ("B", b_dir)):
        m = tmp_path / f"merged-{name}"
        m.mkdir()
        for f in ("config.json",):
            (m / f).write_text((base / f).read_text())
        cfg = ours(base).cfg
        save_file(merged(base_weights(base), load_adapter(d, cfg)), str(m / "model.safetensors"))
        ref = LLM({"model": {"path": str(m)}, "engine": engine})
        assert ref.generate([prompt], greedy(), use_tqdm=False)[0].token_ids == alone[name]
    with pytest.raises(ValueError, match="'C' is not served here"):
        llm.generate([prompt], greedy(), use_tqdm=False, adapter="C")


def test_one_slot_rotating_four_adapters_still_gives_each_its_own_answer(setup, tmp_path):
    """lora.max_loras 1 and four adapters: the planner rotates the one slot
    only when it is quiescent, the executor loads it when a round first
    needs it, and every request's tokens are its solo run's."""
    from pdserve import LLM
    _, base, a_dir, b_dir = setup
    dirs = {"A": a_dir, "B": b_dir, "C": tiny_adapter(tmp_path / "c", seed=3),
            "D": tiny_adapter(tmp_path / "d", seed=4, rank=2)}
    llm = LLM({"model": {"path": str(base)},
               "engine": {"page_size": 4, "total_pages": 128, "max_scheduled_tokens": 16},
               "lora": {"adapters": {k: str(v) for k, v in dirs.items()}, "max_loras": 1,
                        "max_cpu_loras": 4, "max_lora_rank": 8}})
    names = ["A", "B", None, "C", "D", "A", "C", None, "B", "D"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    mixed = [o.token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False,
                                               adapter=names)]
    loads = llm.adapters.loads
    assert loads >= 4                          # the one slot changed hands
    alone = [llm.generate([p], greedy(), use_tqdm=False, adapter=n)[0].token_ids
             for p, n in zip(prompts, names)]
    assert mixed == alone
    llm.engine.planner.assert_idle()


@pytest.mark.device
def test_batched_lora_on_cuda_equals_the_merged_weights(setup):
    """The same batched LoRA on a GPU (float32, the torch attention): a mixed
    batch's rows equal the merged models' on the CPU."""
    _, base, a_dir, b_dir = setup
    model, _ = load_model(str(base), None, dtype="float32", device="cuda", attention="torch")
    a, b = load_adapter(a_dir, model.cfg), load_adapter(b_dir, model.cfg)
    model.enable_lora(slots=2, max_rank=8)
    model.lora.load(0, a)
    model.lora.load(1, b)
    ids, meta, cache, last = batch(model, PROMPTS)
    rows = [s for p, s in zip(PROMPTS, [0, 1, -1]) for _ in p]
    meta.slot_mapping, meta.positions = meta.slot_mapping.cuda(), meta.positions.cuda()
    got = model.forward(ids.cuda(), meta, cache, last.cuda(),
                        lora=LoraRound.of(model.lora, rows)).cpu()
    for i, adapter in enumerate([a, b, None]):
        ref = ours(base, merged(base_weights(base), adapter) if adapter else None)
        want = logits(ref, [PROMPTS[i]])[0]
        assert torch.allclose(got[i], want, atol=1e-4, rtol=1e-4), (got[i] - want).abs().max()
