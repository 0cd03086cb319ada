"""The disk (L3) KV tier's storage: the file store (store.py) and its fake
backend with injected faults, for tests (fake.py)."""
