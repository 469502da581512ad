"""Kernels: which set builds the layers (``resolve``), the layer specs per set (``specs``), and the torch-native
pieces: SDPA core attention with RoPE (``attention``), the vocab-parallel cross entropy (``cross_entropy``),
log-probs/entropy (``logprobs``), an SP-aware norm (``norms``), and compile-on-GPU (``compile``)."""
