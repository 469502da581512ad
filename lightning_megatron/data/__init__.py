"""Data: the download-free byte corpus (``corpus``), pre-tokenized token files and their writer (``tokens``), the
LightningDataModules over both (``modules``), sharding by the data-parallel rank (``sharding``, ``consistency``), and
the training loader that resumes mid-epoch where the checkpoint left it (``resume``)."""
