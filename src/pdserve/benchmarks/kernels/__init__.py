"""The kernels' benchmarks, each against what it replaced or a dense
baseline, in this process: sampling a round's logits (`bench sampling`),
the captured decode step against the eager one (`bench capture`), a GGUF's
weights kept quantized against dequantized (`bench quantized`), and a
batch under several LoRA adapters against the base model (`bench lora`)."""
