"""Model forward, attention backends and sampling (torch).

`load_model(path, preset)` builds a `DecoderModel` (Llama, Qwen2, Mistral),
a `Gemma3Model` (`gemma3.py`), a `Qwen3_5Model` (`qwen3_5.py`, whose
Gated DeltaNet layers keep per-sequence state in a `StateCache`,
`state_cache.py`, instead of K/V) or an `Lfm2Model` (`lfm2.py`, whose
short-conv layers keep a conv state there) from a Hugging Face checkpoint directory,
a GGUF file (`gguf.py`), or a preset (`tiny`, embedded; `smollm2-135m`, a
GGUF a pip package ships), with its tokenizer and chat template
(`chat.py`). The model runs one flat batch a round: every scheduled token
of every request concatenated, writing K/V into paged caches (`kv_cache.py`)
and reading them back through block tables (`attention.py`; on CUDA
`flashinfer_attention.py`), one cache and one table
per request for each cache group (the layers sharing a window,
`ModelConfig.cache_groups`). A Llama-family layer's norms, residual adds
and SwiGLU run flashinfer's fused kernels on CUDA, torch's elsewhere
(`fused_ops.py`). `sampling.py` turns the logits of the rows
that sample into tokens (and logprobs); `detokenize.py` turns tokens into
text a constant amount of work at a time. Speculative decoding guesses
candidates (`proposers.py`: prompt lookup; `draft_model.py`: a draft model
whose K/V share the target's pages) and verifies them (`rejection.py`).
"""
