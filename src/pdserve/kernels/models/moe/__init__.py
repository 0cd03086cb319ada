"""Mixture-of-experts families: Qwen3-MoE and DeepSeek-V3, their experts
and routing (experts.py), DeepSeek's multi-head latent attention over a
cache of one latent entry a token and layer (mla.py), and what a
config.json says of both (specs.py, which ModelConfig carries)."""
