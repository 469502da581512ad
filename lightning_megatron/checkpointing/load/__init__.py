"""Loading: what a load reads and checks when (``plan``), the load itself (``loading``), reading in threads
(``reading``) and loading part of a checkpoint (``partial_load``)."""
