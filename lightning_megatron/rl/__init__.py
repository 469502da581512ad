"""Pieces for RLHF beyond the policy's log-probs: the value model (``value``):
a critic or reward model on the GPT family."""
