"""The executor: a plan carried out on a real model (torch_executor.py),
the round's rows staged for the forward (round_stage.py), the copies
between tiers before it (tier_copies.py), and what it keeps per request
(tracked.py)."""
