"""KV moved between engines over NIXL: a handoff of pages against one raw
NIXL write and a memcpy of the same bytes (`bench transfer`, handoff.py),
and one request's KV between prefill and decode engines of
tensor-parallel sizes 1 and 2, rank to rank (`bench tp-pd`)."""
