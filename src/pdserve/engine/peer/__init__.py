"""The P/D peer protocol on the loop thread: protocol.py (`PeerProtocol`,
membership and dispatch) over its two halves, decode_side.py (asks,
landings, the quarantine, heartbeats) and prefill_side.py (twins, leases,
ships, the ask floor, the reports P owes D), which share base.py (the
engine's parts, the tables, the peers and their incarnations); and the
calls they send, a queue per peer (messages.py)."""
