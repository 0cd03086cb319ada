"""D reads its own host and disk tiers under P/D for models with more than
one cache group: a state model (a random-weight Qwen3.5, checkpoints every
8 tokens) and a sliding-window one (a random-weight Gemma 3, window 8),
under bounded replay and with its windows cached. The peer sends each window's last pages and the final
state whatever D's hit, so D's hit is the full history's pages alone: D
loads the shared prefix from disk and asks P for the pages after it, and
the greedy tokens are those of a fused engine without the tier."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.transfer.disk.fake import FakeStore

from test_disk_pd import PDNode
from support.checkpoints import gemma3_checkpoint
from support.checkpoints import qwen3_5_checkpoint

pytest.importorskip("transformers")

PS = 4
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
COMMON = dict(page_size=PS, total_pages=96, host_pages=48, max_scheduled_tokens=64,
              max_batch_size=4)


def turns() -> list[list[int]]:
    """Two prompts sharing their first 48 tokens (12 pages)."""
    g = torch.Generator().manual_seed(7)
    base = torch.randint(3, 128, (48,), generator=g).tolist()
    return [base + [60 + i, 61 + i, 62 + i, 63 + i, 64 + i] for i in range(2)]


@pytest.fixture(scope="module", params=["qwen3_5", "gemma3", "gemma3-cached"])
def llm(request, tmp_path_factory) -> LLM:
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_5":
        _, path = qwen3_5_checkpoint(d)
        extra = dict(state_block=8)
    else:                                       # cached windows: the peer sends them
        _, path = gemma3_checkpoint(d)
        extra = dict(sliding_pages=64, sliding_replay=request.param == "gemma3")
    return LLM({"model": {"path": str(path)}}, dtype="float32", attention="torch",
               **COMMON, **extra)


def test_d_reads_its_disk_prefix_for_a_model_with_several_groups(llm):
    """Turn 1 fills the node's disk; a restarted node serves turn 2: D
    reads the shared prefix from disk (the full history's pages only: no
    checkpoint read, no window replayed) and asks P for the pages after it;
    the tokens are a fused engine's."""
    reference = [llm.generate([t], SP, use_tqdm=False)[0].token_ids for t in turns()]
    store = FakeStore()
    node = PDNode(llm, store)
    out, first = node.generate("t1", turns()[0])
    assert out == reference[0] and first.first_page == 0
    node.close()
    node = PDNode(llm, store)                   # a restart: device and host empty
    out, second = node.generate("t2", turns()[1])
    assert out == reference[1]
    D = node.D.planner
    assert D.hits.disk_tokens >= 32 and D.hits.disk_missed == 0
    assert second.first_page * PS == D.hits.disk_tokens
    assert node.D.executor.forward_tokens == SP.max_tokens - 1     # decodes only: no replay
    assert node.withheld == 0
    node.close()
