"""Benchmarks behind `pdserve bench`: each prints a table and runs its
baseline side by side in the same process.

Each module is one `pdserve bench NAME`: `main(...)` measures and prints,
`add_arguments(parser)` defines the options it takes and `run(args)` calls
`main` with them (cli/bench.py lists the modules and imports only the one
chosen). None imports torch, Ray or gRPC at module level, so `bench NAME
--help` is quick: they are imported inside the functions that use them."""
