"""Mixture of experts in the GPT family, on Megatron-Core's MoE layer.

* ``config``: checks of ``ModelConfig``'s MoE fields (routers, losses, layer pattern), before anything is built;
* ``specs``: the MoE layer spec with this package's router, experts and dispatcher;
* ``router``: :class:`~lightning_megatron.gpt.moe.router.StepRouter` and the router losses logged every training step
  (``moe_aux_loss``, ``moe_z_loss``);
* ``dispatch``: the all-gather token dispatcher at ``ep=1`` that does not wait for the host;
* ``routing``: routing replay (record a forward pass's expert choices, or make one use given ones).

The experts' kernels (grouped GEMMs, token permutation, per-expert counts) are in ``lightning_megatron.kernels``
(``experts``, ``expert_mlp``, ``permute``, ``expert_counts``), LoRA on experts in ``gpt/lora/experts.py`` and the HF
MoE families in ``gpt/hf/families/`` (``moe.py``, ``qwen3_moe.py``, ``qwen2_moe.py``, ``mixtral.py``). Submodules are
imported by their full name (``from lightning_megatron.gpt.moe.router import StepRouter``): package ``__init__`` files
import nothing (``tests/test_package_layout.py``).
"""
