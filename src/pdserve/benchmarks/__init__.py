"""Benchmarks behind `pdserve bench`: each prints a table and runs its
baseline side by side in the same process.

Each command is one module (`pdserve bench NAME`; cli/bench.py maps the
name to it and imports only the one chosen): `main(...)` measures and
prints, `add_arguments(parser)` defines the options it takes and
`run(args)` calls `main` with them. None imports torch, Ray or gRPC at
module level, so `bench NAME --help` is quick: they are imported inside the
functions that use them.

The commands sit in a folder per what they measure: planner/ (the planner's
cost and its policies in the simulator, the simulator's accuracy), cache/
(KV capacity and reuse, the disk tier), kernels/ (one kernel against what
it replaced), engine/ (one engine in this process), spec/ (speculative
decoding), transfer/ (KV between engines), serving/ (a deployment under
load), structured/ (structured outputs: the schemas, their cost). What several commands share lives in common/ (options, traces,
child processes, clocks, table cells, a hand-built decode round) or, where
only one folder's commands share it, beside them (cache/bounds.py,
spec/workload.py); no command imports another."""
