"""A checkpoint writer process whose disk is full for the checkpoint ``step=4.ckpt`` (tests/test_faults.py): every
write of that checkpoint's shards fails with ENOSPC, in this process or, run as the writer process, in that one;
with ``--die`` the writer process instead kills itself (SIGKILL) when it starts writing that checkpoint."""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
from typing import Any

FULL = "step=4.ckpt"


def fill_the_disk(die: bool = False) -> Any:
    """Make Megatron's shard writes into ``step=4.ckpt`` fail as on a full disk; returns the real write function."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real = filesystem_async._write_item

    @functools.wraps(real)  # Megatron reads its signature
    def write(*args: Any, **kwargs: Any) -> Any:
        stream = next(a for a in args if hasattr(a, "write"))  # after the transforms, if any
        if FULL in str(getattr(stream, "name", "")):
            if die:
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    filesystem_async._write_item = write
    return real


if __name__ == "__main__":
    from lightning_megatron.checkpointing.write_process import serve

    fill_the_disk(die="--die" in sys.argv)
    serve(int(sys.argv[-2]), int(sys.argv[-1]))
