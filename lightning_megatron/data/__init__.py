"""Data: the download-free byte corpus (``corpus``), pre-tokenized token files and their writer (``tokens``), and
the LightningDataModules over both (``modules``)."""
