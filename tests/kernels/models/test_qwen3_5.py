"""Qwen3.5 text (Gated DeltaNet beside full attention) and its state slots,
against Hugging Face transformers on the same weights.

Rounds are made by hand (no planner): each sequence has full-attention
pages handed out in a scrambled order and a state slot of its own; a round
lists extents, prefills first and decodes last, with the StateBatch saying
where each sequence's DeltaNet state comes from and goes. The checkpoint
has 3 DeltaNet layers and 1 attention layer, 2 key heads serving 4 value
heads, a value head dim unlike the key's, and noisy norms.
"""

import copy
import json
import random
from dataclasses import dataclass, field

import pytest
import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.models.gated_delta import chunked_delta_rule, delta_rule_step
from pdserve.kernels.models.loader import load_model
from pdserve.kernels.models.model_config import ModelError, read_config
from pdserve.kernels.models.state_cache import SeqState, StateBatch
from support.planner import save_with_noisy_norms
from support.checkpoints import qwen3_5_checkpoint

transformers = pytest.importorskip("transformers")

PS = 4
TOL = 1e-4
PROMPT = [(7 * i + 3) % 120 + 1 for i in range(50)]
OTHER = [(11 * i + 5) % 120 + 1 for i in range(31)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, directory of its save_pretrained)."""
    return qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5"))


@torch.no_grad()
def reference(hf, ids) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


@dataclass
class Seq:
    slot: int                  # its state slot
    done: int = 0              # tokens already computed
    table: list = field(default_factory=list)


@dataclass
class Extent:
    seq: Seq
    tokens: list
    checkpoint: tuple | None = None
    read: int | None = None    # the slot its state comes from, if not its own


class Rounds:
    """One model, its attention pages and its state slots."""

    def __init__(self, model, pages: int = 96, slots: int = 8, seed: int = 0):
        self.model = model
        self.cache = model.new_cache(pages, PS)
        self.states = model.new_state_cache(slots)
        self.free_pages = list(range(pages))
        random.Random(seed).shuffle(self.free_pages)
        self.free_slots = list(range(slots))

    def new_seq(self) -> Seq:
        return Seq(self.free_slots.pop(0))

    def run(self, extents: list, num_decodes: int = 0) -> list:
        """One forward over the extents (the last `num_decodes` are decodes);
        every row's logits, per extent."""
        seqs, states, ids, pos, slots = [], [], [], [], []
        for e in extents:
            s, n = e.seq, len(e.tokens)
            while len(s.table) * PS < s.done + n:
                s.table.append(self.free_pages.pop())
            seqs.append(SeqMeta(len(ids), n, s.done + n, s.table))
            read = e.read if e.read is not None else s.slot if s.done else -1
            states.append(SeqState(read, s.slot, e.checkpoint))
            span = range(s.done, s.done + n)
            ids += e.tokens
            pos += span
            slots += [s.table[p // PS] * PS + p % PS for p in span]
        meta = BatchMeta(seqs, torch.tensor(slots), torch.tensor(pos), num_decodes=num_decodes)
        logits = self.model.forward(torch.tensor(ids), meta, self.cache,
                                    torch.arange(len(ids)), StateBatch(self.states, states))
        for e in extents:
            e.seq.done += len(e.tokens)
        return [logits[m.q_start:m.q_start + m.q_len] for m in seqs]


def qwen(d):
    return load_model(str(d), preset=None, dtype="float32", attention="torch")[0]


def assert_close(got, want, tol=TOL, what=""):
    err = float((got - want).abs().max())
    assert err < tol, f"{what} off by {err:.3g}"


# ---- model facts -----------------------------------------------------------------------

def test_attention_layers_make_one_full_group_and_deltanet_layers_hold_state(checkpoint):
    _, d = checkpoint
    cfg = read_config(d)
    assert cfg.arch == "qwen3_5" and cfg.partial_rotary_factor == 0.25
    (full,) = cfg.cache_groups()
    assert not full.sliding and full.layers == (3,)
    assert cfg.state_layers() == (0, 1, 2)
    assert cfg.conv_state_shape() == (2 * 2 * 16 + 4 * 8, 3)
    assert cfg.recurrent_state_shape() == (4, 16, 8)
    model = qwen(d)
    states = model.new_state_cache(5)
    assert states.conv.shape == (5, 3, 96, 3) and states.recurrent.shape == (5, 3, 4, 16, 8)
    assert states.slot_bytes() == cfg.state_slot_bytes(4) == 3 * (96 * 3 * 4 + 4 * 16 * 8 * 4)
    states.recurrent[1] = 1.0
    states.copy(1, 3)
    assert states.recurrent[3].eq(1).all()
    states.zero(1)
    assert not states.recurrent[1].any() and states.recurrent[3].eq(1).all()


def test_the_recurrent_state_stays_float32_in_a_bfloat16_model(checkpoint):
    _, d = checkpoint
    model = load_model(str(d), preset=None, dtype="bfloat16", attention="torch")[0]
    states = model.new_state_cache(2)
    assert states.conv.dtype == torch.bfloat16 and states.recurrent.dtype == torch.float32
    assert read_config(d).state_slot_bytes(2) == states.slot_bytes()


def test_the_multimodal_qwen3_5_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
         "text_config": {"model_type": "qwen3_5_text"}}))
    with pytest.raises(ModelError, match="text-only Qwen3_5ForCausalLM"):
        load_model(str(tmp_path), preset=None)


# ---- the delta rule ----------------------------------------------------------------------

def test_the_chunked_rule_is_the_recurrent_rule_over_several_chunks():
    """37 rows in chunks of 8 (the last one padded), from a non-zero state."""
    torch.manual_seed(1)
    T, H, dk, dv = 37, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, dk), dim=-1) for _ in range(2))
    v = torch.randn(T, H, dv)
    g, beta = -torch.rand(T, H), torch.rand(T, H)
    state0 = torch.randn(H, dk, dv)
    got, state = chunked_delta_rule(q, k, v, g, beta, state0, chunk=8)
    s, want = state0[None], []
    for t in range(T):
        o, s = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        want.append(o[0])
    assert_close(got, torch.stack(want), 1e-5, "outputs")
    assert_close(state, s[0], 1e-5, "final state")


# ---- against transformers ----------------------------------------------------------------

def test_a_whole_prompt_and_greedy_decode_match_transformers(checkpoint):
    hf, d = checkpoint
    r = Rounds(qwen(d))
    seq = r.new_seq()
    (rows,) = r.run([Extent(seq, PROMPT)])
    assert_close(rows, reference(hf, PROMPT), what="prompt logits")
    out = [int(rows[-1].argmax())]
    decoded = []
    for _ in range(15):
        (row,) = r.run([Extent(seq, out[-1:])], num_decodes=1)
        decoded.append(row[0])
        out.append(int(row[0].argmax()))
    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    assert out == want[0, len(PROMPT):].tolist()
    full = reference(hf, PROMPT + out[:-1])
    assert_close(torch.stack(decoded), full[len(PROMPT):], what="decode logits")


def test_in_bfloat16_the_logits_round_where_transformers_rounds(checkpoint):
    """Each rounding to the model dtype in the reference's place: bfloat16
    against transformers' bfloat16 within a unit or two in the last place,
    ten times closer than either is to float32."""
    hf, d = checkpoint
    model = load_model(str(d), preset=None, dtype="bfloat16", attention="torch")[0]
    r = Rounds(model)
    (rows,) = r.run([Extent(r.new_seq(), PROMPT)])
    with torch.no_grad():
        want = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([PROMPT])).logits[0].float()
    assert float((want - reference(hf, PROMPT)).abs().max()) > 0.1
    assert_close(rows, want, 0.04, "bfloat16 logits")


@pytest.mark.parametrize("chunk", [16, 7, 1])
def test_a_chunked_prompt_passes_its_state_slot_to_slot(checkpoint, chunk):
    hf, d = checkpoint
    r = Rounds(qwen(d))
    seq = r.new_seq()
    rows = [r.run([Extent(seq, PROMPT[i:i + chunk])])[0] for i in range(0, len(PROMPT), chunk)]
    assert_close(torch.cat(rows), reference(hf, PROMPT), what=f"chunk {chunk} logits")


def test_a_checkpoint_is_the_state_of_a_run_over_its_rows_and_resumes_a_prefix_hit(checkpoint):
    """One forward over the prompt leaves its state after 24 rows in a
    checkpoint slot, equal to a separate run over those 24 tokens alone.
    Two requests that hit the 24-token prefix continue from it in one
    round, sharing its pages: one with the rest of the prompt, after
    copying the checkpoint into its own slot; one with another suffix,
    reading the checkpoint slot itself. Both are the unbroken runs, and the
    checkpoint is left as it was."""
    hf, d = checkpoint
    k = 24
    r = Rounds(qwen(d))
    seq, mark = r.new_seq(), r.free_slots.pop(0)
    (whole,) = r.run([Extent(seq, PROMPT, checkpoint=(k, mark))])
    alone = r.new_seq()
    r.run([Extent(alone, PROMPT[:k])])
    for what in ("conv", "recurrent"):
        assert_close(getattr(r.states, what)[mark], getattr(r.states, what)[alone.slot], 1e-5,
                     f"checkpoint {what} state")
    hits = []
    for _ in range(2):
        hit = r.new_seq()
        hit.done, hit.table = k, seq.table[:k // PS]
        hits.append(hit)
    r.states.copy(mark, hits[0].slot)
    kept = r.states.recurrent[mark].clone()
    rest, other = r.run([Extent(hits[0], PROMPT[k:]), Extent(hits[1], OTHER, read=mark)])
    assert torch.equal(r.states.recurrent[mark], kept)
    assert_close(rest, whole[k:], what="resumed vs unbroken")
    assert_close(rest, reference(hf, PROMPT)[k:], what="resumed vs transformers")
    assert_close(other, reference(hf, PROMPT[:k] + OTHER)[k:], what="other suffix")


def test_a_prefill_beside_decodes_equals_each_run_alone(checkpoint):
    """A 31-token prompt prefilled in the round where a 50-token and a
    20-token sequence decode: each row as when its sequence runs alone."""
    _, d = checkpoint
    model = qwen(d)
    prompts = [PROMPT, OTHER, PROMPT[5:25]]
    alone = []
    for i, p in enumerate(prompts):
        r = Rounds(model, seed=i)
        seq = r.new_seq()
        if i == 1:
            alone.append(r.run([Extent(seq, p)])[0])
        else:
            r.run([Extent(seq, p[:-1])])
            alone.append(r.run([Extent(seq, p[-1:])], num_decodes=1)[0])
    r = Rounds(model, seed=7)
    a, b, c = (r.new_seq() for _ in prompts)
    r.run([Extent(a, PROMPT[:-1]), Extent(c, prompts[2][:-1])])
    got = r.run([Extent(b, OTHER), Extent(a, PROMPT[-1:]), Extent(c, prompts[2][-1:])],
                num_decodes=2)
    for g, want, what in zip(got, [alone[1], alone[0], alone[2]], ("prefill", "decode 50",
                                                                   "decode 20")):
        assert_close(g, want, 1e-5, what)


# ---- the StateBatch contract ---------------------------------------------------------------

def test_a_continuing_sequence_must_read_its_state_and_no_slot_is_written_twice(checkpoint):
    _, d = checkpoint
    r = Rounds(qwen(d))
    seq = r.new_seq()
    r.run([Extent(seq, PROMPT[:8])])
    meta = [SeqMeta(0, 4, 12, seq.table)]
    with pytest.raises(ValueError, match="continues at position 8"):
        StateBatch(r.states, [SeqState(-1, seq.slot)]).check(meta)
    with pytest.raises(ValueError, match="writes some state slot twice"):
        StateBatch(r.states, [SeqState(seq.slot, 3, checkpoint=(2, 3))]).check(meta)
    with pytest.raises(ValueError, match="checkpoint"):
        StateBatch(r.states, [SeqState(seq.slot, 3, checkpoint=(5, 4))]).check(meta)
    ids = torch.tensor(PROMPT[8:12])
    with pytest.raises(ValueError, match="pass states"):
        r.model.forward(ids, BatchMeta(meta, torch.zeros(4, dtype=torch.long),
                                       torch.arange(8, 12)), r.cache, torch.arange(4))
