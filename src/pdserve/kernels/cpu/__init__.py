"""pdserve's own CPU path, in C with AVX2 and Python drivers: what a small
model's rows run on a CPU where torch's kernels spend most of a step on
something other than arithmetic (dequantizing weights, gathering pages, one
operator per step of a softmax; docs/benchmarks.md has the measurements).
Every product sums in an order these files fix, so a row's bits do not
depend on what shares its round (docs/configuration.md).

- quantized.py: a GGUF's 4- and 8-bit weights kept quantized
  (`QuantizedLinear`), the load's choice, who multiplies which rows.
- matmul.c, matmul.py: the file's blocks times rows cut into 8-bit blocks,
  in integers (AVX2, AVX512-VNNI where present).
- bf16.c: a prompt's rows times a bfloat16 model's weights in one
  AVX512-BF16 pass.
- dense.c: rows times a dense float32 or bfloat16 weight (a dense copy, the
  head) in a fixed order, AVX2 and FMA only.
- attention.c, attention.py: rows' attention read in place from the pages.
- layer.c, layer.py: every row of a round through a whole Llama-family
  layer in one call.
- pool.c: the threads a job's items are shared among.
- native.py: the build and the ctypes signatures; features.py: the CPU's
  flags.
"""
