"""Tensor parallelism in the model: a TP 2 shard set computes what TP 1
does. Two ranks are two spawned processes on gloo (127.0.0.1); each loads
the same checkpoint, keeps its shard, and runs the same greedy rounds over
its own paged cache. Logits agree within 1e-5 (float32) and the greedy
tokens are identical, for each family pdserve shards; the families it does
not shard are refused by name."""

import dataclasses

import pytest
import torch

from pdserve.kernels.attention import TorchAttention
from pdserve.kernels.models.loader import attention_shape, build_model, load_model, load_shard
from pdserve.kernels.models.model import random_weights
from pdserve.kernels.models.model_config import ModelConfig, tiny_config
from pdserve.kernels.tensor_parallel import TpError, tp_layout
from support.tp import greedy, run_ranks


TOL = 1e-5
PROMPTS = [[5, 17, 33, 2, 9, 41, 8], [60, 3, 3, 27]]
STEPS = 6


def _qwen2(tmp_path, **kw):
    import transformers
    from support.planner import save_with_noisy_norms

    torch.manual_seed(0)
    conf = dict(vocab_size=127, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=512, initializer_range=0.1,
                tie_word_embeddings=False, **kw)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**conf)).float().eval()
    return save_with_noisy_norms(model, tmp_path)[1]


def _gemma3(tmp_path):
    import transformers
    from support.planner import save_with_noisy_norms

    torch.manual_seed(0)
    conf = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                sliding_window=64, sliding_window_pattern=3, max_position_embeddings=512,
                query_pre_attn_scalar=16, initializer_range=0.1, final_logit_softcapping=30.0,
                tie_word_embeddings=True)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**conf))
    return save_with_noisy_norms(model.float().eval(), tmp_path / "gemma3")[1]


def _model(path, comm=None):
    """A checkpoint directory's model, or (path a ModelConfig) a Llama of
    seeded random weights of that shape; a rank's shard with `comm`."""
    if not isinstance(path, ModelConfig):
        return load_model(path, preset=None if path else "tiny", dtype="float32",
                          attention="torch", tp=comm)[0]
    weights = random_weights(path, seed=7)
    if comm is not None:
        return load_shard(path, weights, comm, torch.float32, "cpu", "torch")
    return build_model(path, weights, torch.float32, "cpu",
                       TorchAttention(**attention_shape(path)))


def _shard_greedy(comm, paths):
    out = []
    for path in paths:
        logits, tokens = greedy(_model(path, comm), PROMPTS, STEPS)
        out.append(([x.numpy() for x in logits], tokens))   # numpy: plain pickles
    return out


def _check(paths) -> None:
    got = run_ranks(_shard_greedy, 2, paths)
    for path, (logits, tokens) in zip(paths, got):
        want, want_tokens = greedy(_model(path), PROMPTS, STEPS)
        assert tokens == want_tokens, path
        for w, g in zip(want, map(torch.from_numpy, logits)):
            assert g.shape == w.shape
            assert torch.allclose(g, w, atol=TOL, rtol=0), (path, (g - w).abs().max())


def test_tp2_equals_tp1_for_the_llama_family():
    """Logits within 1e-5 and the same greedy tokens, on two ranks: the
    tiny preset (4 query heads, 2 KV heads split, vocabulary 98: 49 rows a
    rank); and a Llama with q/k/v biases (Qwen2's), one KV head (held by
    both ranks) and a vocabulary of 97 (the second rank's rows padded with
    a zero row, cut from the gathered logits); and 8 heads over 4 KV heads
    and 16 over 8 (2 and 4 KV heads a rank, as Llama 3 8B's 8 KV heads at
    TP 2: a rank's K/V rows are all of its heads', not its first head's).
    One spawn runs them all: starting the two processes is most of the
    cost."""
    odd = dataclasses.replace(tiny_config(), num_kv_heads=1, vocab_size=97,
                              attention_bias=True, arch="qwen2")
    two_a_rank = dataclasses.replace(tiny_config(), num_heads=8, num_kv_heads=4, head_dim=8)
    four_a_rank = dataclasses.replace(tiny_config(), num_heads=16, num_kv_heads=8, head_dim=4)
    _check([None, odd, two_a_rank, four_a_rank])


@pytest.mark.slow       # transformers' checkpoints, four models on each rank: ~40 s on 2 cores
def test_tp2_equals_tp1_for_checkpoints_of_each_sharded_family(tmp_path):
    """The same from Hugging Face checkpoints: Qwen2 (biases, a vocabulary
    of 127) with 2 KV heads and with 1; Gemma 3 (local and global cache
    groups, q/k norms, post-norms after the row-parallel sums, tied
    embeddings, a final logit softcap)."""
    _check([str(_qwen2(tmp_path / "a", num_key_value_heads=2)),
            str(_qwen2(tmp_path / "b", num_key_value_heads=1)), str(_gemma3(tmp_path))])


def test_layout_splits_and_replicates_kv_heads():
    cfg = tiny_config()                   # 4 query heads, 2 KV heads
    two = tp_layout(cfg, 2)
    assert (two.heads, two.kv_heads, two.kv_replicas) == (2, 1, 1)
    assert [two.kv_heads_of(r) for r in range(2)] == [range(0, 1), range(1, 2)]
    four = tp_layout(cfg, 4)
    assert (four.heads, four.kv_heads, four.kv_replicas) == (1, 1, 2)
    # query head h reads KV head h // 2: ranks 0, 1 hold KV head 0; ranks 2, 3 head 1
    assert [four.kv_heads_of(r).start for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2"])
def test_unsharded_families_are_refused_by_name(arch):
    cfg = dataclasses.replace(tiny_config(), arch=arch)
    with pytest.raises(TpError, match=f"with a {arch} model"):
        tp_layout(cfg, 2)
    assert tp_layout(cfg, 1).size == 1


def test_sizes_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(TpError, match="does not divide the model's 4 query heads"):
        tp_layout(tiny_config(), 3)
    with pytest.raises(TpError, match="one must divide the other"):
        tp_layout(dataclasses.replace(tiny_config(), num_heads=6, num_kv_heads=3), 2)
