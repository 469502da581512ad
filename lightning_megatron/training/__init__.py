"""Training-time pieces the strategy runs: the optimizer adapter and LR schedule, grad clipping on multi-tensor
kernels, non-finite and bad-data guards, and offloading training state off the accelerator."""
