"""The entry point of the async-save writer process (:mod:`.write_process`): ``python -m`` runs this module, which
the package itself never imports (running an imported module as ``__main__`` would load it twice)."""

import sys

from lightning_megatron.checkpointing.write_process import serve

if __name__ == "__main__":
    serve(int(sys.argv[-2]), int(sys.argv[-1]))
