"""The text side of a request, without torch: tokenizers (tokenizer.json or a
GGUF's vocabulary), chat templates rendered in a sandbox, incremental
detokenization with stop strings, and a request's sampling parameters. The
router, the engines' output thread and the offline API share it; the model
code (kernels/) turns the parameters into tokens."""
