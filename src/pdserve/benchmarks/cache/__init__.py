"""The KV cache's capacity and reuse: sliding-window groups against every
layer full (`bench cache-groups`, groups.py), snapshot-state groups against
vLLM-style pages (`bench state-capacity`), prefix hits with state
checkpoints on and off (`bench state-reuse`), and the disk tier below the
host one (`bench disk`). bounds.py holds what they measure against: the
KV pool GPUs have, and the hits a trace allows."""
