"""The LightningModules: the base contract (``base``), the causal LM (``lm``), the value model (``value``), the
fine-tune-from-HF module (``hf_finetune``), and what they use: MoE routing replay (``routing``), perplexity
(``metrics``)."""
