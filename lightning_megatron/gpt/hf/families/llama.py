"""Llama and Mistral (``LlamaForCausalLM``, ``MistralForCausalLM``): no biases, no q/k norms, a dense SwiGLU MLP."""

from __future__ import annotations

from lightning_megatron.gpt.hf.families.base import Family


class Llama(Family):
    """Llama 2/3 and Mistral: the shared decoder layout unchanged. A model with neither q/k/v biases nor q/k norms
    is exported as Llama (Mistral's tensors are named and shaped alike)."""

    architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    model_types = ("llama", "mistral")
    export_architecture = "LlamaForCausalLM"
    config_class = "LlamaConfig"
