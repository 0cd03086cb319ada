"""LoRA adapters at the router: loaded and unloaded while serving
(admin.py), and held by every live engine, restarted ones too (sync.py)."""
