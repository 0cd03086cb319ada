"""Speculative decoding on the engine: which rounds carry drafts and how a
verify round is built and landed (round.py, speculation.py), the gate that
turns it off where it does not pay (gate.py), and a draft model's rounds
(draft.py). The proposers and verification are kernels/spec/'s."""
