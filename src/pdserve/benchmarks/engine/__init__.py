"""One engine in this process, no server: `pdserve.LLM` against Hugging Face
`generate` (`bench llm`), where a fused engine's round goes and what
overlapping the planner with the forward saves (`bench loop`), and what
sharing a round with a tensor-parallel engine's other ranks costs
(`bench tp-plan`)."""
