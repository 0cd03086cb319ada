"""Benchmarks behind `pdserve bench`: each prints a table and runs its
baseline side by side in the same process."""
