"""Model forward and attention backends. Empty until the engine issue lands."""
