"""The engine: one loop that turns plans into work, for every role.

`Engine(planner, executor)` builds a plan, has the executor carry it out
(`SimExecutor` advances a virtual clock with a cost model; a torch executor
runs the real model) and applies the result back to the planner.
"""
