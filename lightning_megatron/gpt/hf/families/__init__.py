"""One module per Hugging Face architecture family: its config fields, its weight names, ``to_hf``/``from_hf``."""
