"""Putting engines together: config files, the CLI, the router, and the
simulated cluster behind `pdserve sim`."""
