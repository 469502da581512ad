"""Data: the download-free byte corpus (``corpus``), pre-tokenized token files and their writer (``tokens``), the
LightningDataModules over both (``modules``), and sharding by the data-parallel rank (``sharding``, ``consistency``)."""
