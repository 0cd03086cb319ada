"""The NIXL transport: an engine's agent over UCX, the transport built on it,
and a NIXL peer in its own process for two-process tests and benchmarks."""
