"""Per-rank KV transfer between tensor-parallel engines: who sends which
heads to whom (pieces.py), each rank's NIXL agent (rank_agent.py), and how
the ranks' pieces add up to one event per write (rank_writes.py)."""
