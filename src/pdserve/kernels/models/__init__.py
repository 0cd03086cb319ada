"""The model families and their checkpoints: the Llama family (model.py,
with `PagedDecoder`, what every family shares), Gemma 3, Qwen3.5 and LFM2,
their mixers and state (gated_delta.py, state_cache.py), rotary positions,
architecture facts (model_config.py), and loading a checkpoint directory, a
GGUF file or a preset (loader.py, gguf.py)."""
