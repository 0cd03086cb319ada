"""Benchmarks behind `pdserve bench`: each prints a table and runs its
baseline side by side in the same process.

Each module is one `pdserve bench NAME`: `main(...)` measures and prints,
`add_arguments(parser)` defines the options it takes and `run(args)` calls
`main` with them (cli/main.py lists the modules). Building the parser
imports every module, so none imports torch, Ray or gRPC at module level:
they are imported inside the functions that use them."""
