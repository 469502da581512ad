"""The GPT model family: ``ModelConfig`` (``config``), the kernel plan (``plan``), the Megatron build (``transformer``,
``specs``), the LightningModules (``model``, ``lm``), packed/CP token handling (``sequences``), MoE routing replay
(``routing``), LoRA (``lora/``) and Hugging Face in and out (``hf/``)."""
