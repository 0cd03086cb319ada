"""pdserve: LLM serving with prefill and decode disaggregated across a Ray cluster.

Subpackages, from the bottom up: `scheduler` (the planner every engine
runs), `text` (tokenizers, chat, detokenizing, sampling parameters; no
torch), `kernels` (model forward, sampling), `transfer` (KV movement),
`engine` (one engine of any role: its loop, RPC, peers, TP ranks, disk tier,
adapters, speculation), `router` (requests, streams, the HTTP and gRPC fronts),
`cluster` (a deployment on Ray), `sim` (simulation, plan search,
calibration), `cli` (the `pdserve` command), `benchmarks`. `config` is
the one config schema they share. The offline API,
`pdserve.LLM` and `pdserve.SamplingParams`, loads torch on first use.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.text.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
