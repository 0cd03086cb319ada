"""The engine: one loop that turns plans into work, for every role.

`Engine(planner, executor)` builds a plan, has the executor carry it out
(`SimExecutor` advances a virtual clock with a cost model; a torch executor
runs the real model) and applies the result back to the planner.
`EngineServer` serves it over gRPC, built from those parts (the wiring
from a deployment's config is cluster/actors.py's): its loop thread
(`loop.py`) owns the planner, the output thread (`outputs.py`) turns tokens
into each router's events, the P/D peer protocol (`peer/protocol.py`, its
messages in `peer/messages.py`) moves KV between engines, and a drain
(`drain.py`) retires an engine without losing a request. A sub-package a
concept: `tp/` (a tensor-parallel engine's leader, worker ranks and their
KV), `spec/` (speculative rounds), `disk/` (the disk tier's edge), `lora/`
(the adapters an engine holds), `peer/` (the P/D protocol).
"""
