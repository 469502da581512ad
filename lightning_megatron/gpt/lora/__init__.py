"""LoRA on Megatron's parallel linears: the configuration (``config``) and the tensor-parallel adapters (``layers``)."""
