"""The LoRA adapters an engine holds: loads copied into device slots
(adapters.py) from host memory (host.py)."""
