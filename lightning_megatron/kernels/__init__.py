"""Torch-native kernels, free of any model family: SDPA core attention with RoPE (``attention``), document masks and
CP key/value gathering (``documents``), parallel linears with fused wgrad and fp8 (``linear``, ``fp8``), the
vocab-parallel cross entropy (``cross_entropy``), log-probs/entropy (``logprobs``), an SP-aware norm (``norms``), and
compile-on-GPU (``compile``). Which set builds a GPT's layers is ``lightning_megatron.gpt.plan``."""
