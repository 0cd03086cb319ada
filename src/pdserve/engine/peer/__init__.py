"""The P/D peer protocol on the loop thread (protocol.py: RemotePrefill,
ship, landings, fences, leases, acks, heartbeats) and the calls it sends
(messages.py)."""
