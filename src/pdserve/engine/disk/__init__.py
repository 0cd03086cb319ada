"""The engine's edge to the disk (L3) tier: probes, prefetch and a round's
copies (tier.py), per cache group (groups.py). Storage is
transfer/disk/store.py's."""
