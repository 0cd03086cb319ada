"""LoRA adapters on the model side: a PEFT directory read and checked
(adapter.py), the device slots' stacks and a round's rows grouped by slot
(batched.py), the fused Triton kernels on CUDA (fused.py, triton_kernels.py)
and the first, masked batching kept for comparison (masked.py). Which
adapter a request runs and which slot holds it is the engine's
(engine/lora/adapters.py) and the planner's (scheduler/lora/slots.py)."""
