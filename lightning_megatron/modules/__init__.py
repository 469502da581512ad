"""The LightningModule contract between the strategy and a model (``base``) and the perplexity metric (``metrics``).
Model families build on it: ``lightning_megatron.gpt``, ``lightning_megatron.rl``."""
