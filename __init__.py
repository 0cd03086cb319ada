"""pdserve: LLM serving with prefill and decode disaggregated across a Ray cluster.

Subpackages: `scheduler` (the planner every engine runs), `roles` (the
engine loop and its executors), `cluster` (config, CLI, simulation driver),
`transfer` (KV movement) and `kernels` (model forward). The offline API,
`pdserve.LLM` and `pdserve.SamplingParams`, loads torch on first use.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.kernels.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
