"""Hugging Face in and out: config mapping (``config``), the weight-name table (``mapping``), import with per-rank
slice reads (``load``), export by streaming or ``save_pretrained`` (``export``), opt-in pickle weights (``pickled``)."""
