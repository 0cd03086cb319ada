"""Model forward, attention backends and sampling (torch).

`load_model(ModelSpec)` builds a `DecoderModel` (Llama, Qwen2, Mistral) from
a Hugging Face checkpoint directory or the embedded `tiny` preset, with its
tokenizer. The model runs one flat batch a round: every scheduled token of
every request concatenated, writing K/V into a paged cache and reading it
back through block tables (`attention.py`). `sampling.py` turns the logits
of the rows that sample into tokens.
"""
