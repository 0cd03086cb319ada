"""KV movement between engines (P -> D). Empty until the transfer issue lands."""
