"""A checkpoint writer process whose disk is full for the checkpoint ``step=4.ckpt`` (tests/test_faults.py): every
write of that checkpoint's shards fails with ENOSPC, in this process or, run as the writer process, in that one;
with ``--die`` the writer process instead kills itself (SIGKILL) when it starts writing that checkpoint.

``--errno=EFBIG`` (any errno's name; ``fill_the_disk(error=...)`` here) fails that checkpoint's shard files the way
the kernel does instead: a write partway through them -- inside ``torch.save``, whose zip writer then reports only
"unexpected pos" -- raises ``OSError`` with that errno (tests/test_save_failures.py). ``--fsize=N`` is the real thing
for EFBIG: the writer process may write no file past ``N`` bytes (``RLIMIT_FSIZE``, SIGXFSZ ignored), any checkpoint."""

from __future__ import annotations

import errno
import functools
import os
import resource
import signal
import sys
from typing import Any

FULL = "step=4.ckpt"
REFUSED_PAST = 4096  # bytes of a shard file written before its writes fail: a few of torch.save's zip records


def fill_the_disk(die: bool = False, error: int = errno.ENOSPC) -> Any:
    """Make Megatron's shard writes into ``step=4.ckpt`` fail as on a full disk (or with ``error``, from the shard
    file's writes); returns the real write function."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    real = filesystem_async._write_item

    @functools.wraps(real)  # Megatron reads its signature
    def write(*args: Any, **kwargs: Any) -> Any:
        stream = next(a for a in args if hasattr(a, "write"))  # after the transforms, if any
        if FULL in str(getattr(stream, "name", "")):
            if die:
                os.kill(os.getpid(), signal.SIGKILL)
            if error == errno.ENOSPC:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            args = tuple(Refusing(a, error) if a is stream else a for a in args)
        return real(*args, **kwargs)

    filesystem_async._write_item = write
    return real


class Refusing:
    """A shard file whose writes fail with ``error`` once it would hold more than ``REFUSED_PAST`` bytes."""

    def __init__(self, stream: Any, error: int) -> None:
        self._stream, self._error = stream, error

    def write(self, data: Any) -> int:
        if self._stream.tell() + memoryview(data).nbytes > REFUSED_PAST:
            raise OSError(self._error, os.strerror(self._error))
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _option(name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), None)


def _writer_main() -> Any:
    """The package's writer entry point (``writer_main.py``) as a module, and ``lightning_megatron`` and
    ``megatron.core`` entered as it enters them before it serves: without running their ``__init__`` (Lightning,
    the models: seconds of imports the writer does not need). This writer starts as the real one does."""
    import importlib.util
    from pathlib import Path

    package: Any = importlib.util.find_spec("lightning_megatron")  # found, not imported
    main = Path(package.origin).parent / "checkpointing" / "save" / "writer_main.py"
    spec: Any = importlib.util.spec_from_file_location("_writer_main", main)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its definitions: the writer's start is under ``__main__``
    module.lean_imports().enter(module.package_root())
    return main


if __name__ == "__main__":
    import runpy

    writer_main = _writer_main()
    if (size := _option("fsize")) is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(size), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    else:
        fill_the_disk(die="--die" in sys.argv, error=getattr(errno, _option("errno") or "ENOSPC"))
    runpy.run_path(str(writer_main), run_name="__main__")  # the real writer from here: its imports, then serve()
