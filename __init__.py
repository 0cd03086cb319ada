"""pdserve: LLM serving with prefill and decode disaggregated across a Ray cluster.

Subpackages: `scheduler` (the planner every engine runs), `roles` (the
engine loop and its executors), `cluster` (config, CLI, simulation driver),
`transfer` (KV movement) and `kernels` (model forward).
"""

__version__ = "0.1.0"
