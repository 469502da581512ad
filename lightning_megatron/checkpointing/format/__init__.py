"""The checkpoint format beside the sharded state dict (``sharded.py``): the module's state outside its chunks,
the distributed optimizer's state built per parameter, split by expert-parallel size, and the trained weights
stored as the optimizer's main weights."""
