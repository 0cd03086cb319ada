"""A tensor-parallel engine: rank 0 (leader.py) drives worker ranks in
processes of their own (worker.py) over typed messages (messages.py); each
rank's KV shard and its transfer (kv_ranks.py, transfer.py); the main-module
guard a spawned rank needs (main_module.py)."""
