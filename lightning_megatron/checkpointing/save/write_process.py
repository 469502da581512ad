"""The background writer of async saves: one process per rank, started when a fit starts and kept for it.

A process forked per save (Megatron's async writer) faults the staged buffers' pages into itself again at every save
(``benchmarks/writer_probe.py``). This writer is a fresh interpreter (``python .../save/writer_main.py``: it runs no
user code, uses no GPU and imports only what writing needs), started once; it maps each shared memory segment of the
host buffers (:mod:`.shared_memory`) once, when it first sees it, and writes each save with Megatron's own writer
function (the same files as a synchronous save), recording the checksums as it goes (the function :mod:`.saving`
hands over).

The training process sends it, per save, the write plan with each tensor named by its segment and offset (from a
thread, so that a writer still starting does not hold up the training step); the writer answers with Megatron's
write results (or the error). The publish stays in the training process, run on every
rank once every rank's writer is done (:class:`.background.BackgroundSaves`). Each answer carries when the writer
began and ended the write (``time.monotonic``, one clock for the machine's processes): :attr:`WriterProcess.last_write`.

The writer blocks SIGTERM and ignores SIGINT: a job-wide SIGTERM leaves the write running, and the rank publishes it
at its next step (training/preemption.py). It exits when asked at the end of the fit, when the training process dies
(``PR_SET_PDEATHSIG``), or is killed by it after a failure.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.checkpointing.save.shared_memory import SharedSegments, map_segment, tensor_at

_MAIN = Path(__file__).with_name("writer_main.py")
COMMAND = (
    [sys.executable, "-P", str(_MAIN)]  # -P: the script's directory is not put on sys.path
    if _MAIN.is_file()
    else [sys.executable, "-m", "lightning_megatron.checkpointing.save.writer_main"]  # a zipped install
)
"""How the writer process is started (the training process's pid and the connection's descriptor are appended)."""
_EXIT_WAIT_S = 60.0  # for an idle writer to exit when asked, before it is killed
_PARENT_CHECK_S = 1.0  # how often an idle writer checks that the training process still runs


class WriterProcess:
    """The training process's end of one writer process: hands it segments and saves, and takes its answers."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with children_ignore_sigterm():  # until it blocks SIGTERM itself
            command = [*COMMAND, str(os.getpid()), str(theirs.fileno())]
            self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), env=env)
        self._spawned = time.monotonic()
        theirs.close()
        self._socket = ours
        self._connection = Connection(os.dup(ours.fileno()))
        _LIVE.add(self)
        self._mapped: set[int] = set()  # segments the writer maps
        self.segments_sent = 0
        """Segments handed to the writer so far: a later save of the same buffers hands over none."""
        self.busy = False
        """Whether a save was sent and its answer not yet taken."""
        self._sender: threading.Thread | None = None
        self._send_error: Exception | None = None
        self._handed = 0.0  # when the save sent last was handed over (time.monotonic)
        self.last_write: dict[str, float] = {}
        """Of the save answered last: ``writer_wait_s``, from the handoff until the writer began writing it (a
        writer still starting, the handoff's transfer), ``write_s``, its write (shards and checksums), and
        ``writer_start_s``, how long the writer took from its start to serving (its imports)."""

    def write(self, function: Any, rank: int, buckets: list, shared: SharedSegments) -> None:
        """Hand over one save: Megatron's write function and its buckets, every tensor cut from ``shared`` named by
        its segment and offset (others, if any, sent as their bytes). Sent by a thread: a writer still starting
        (importing) does not hold up the training step."""
        assert not self.busy, "one save at a time"
        plan = [(path, key, (data, [(item, _describe(t, shared)) for item, t in tensors]))
                for path, key, (data, tensors) in buckets]  # fmt: skip
        messages = [*self._segment_messages(shared), (("write", function, rank, plan), None)]
        self._send_error = None
        self._handed = time.monotonic()
        self._sender = threading.Thread(target=self._send_all, args=(messages,), name="checkpoint-handoff", daemon=True)
        self._sender.start()
        self.busy = True

    def segments(self, shared: SharedSegments | None) -> None:
        """Make the writer map exactly ``shared``'s segments: new ones handed over, dropped ones unmapped."""
        assert not self.busy, "not while a save is handed over"
        self._send_all(self._segment_messages(shared))
        if self._send_error is not None:
            code = self._replace()
            error = RuntimeError(f"the checkpoint writer process (exit code {code}) could not take its segments")
            raise error from self._send_error

    def _segment_messages(self, shared: SharedSegments | None) -> list[tuple[tuple, int | None]]:
        """The messages (each with the descriptor to pass along, if any) that make the writer map ``shared``."""
        live = {} if shared is None else shared.segments
        messages: list[tuple[tuple, int | None]] = []
        for index in sorted(live.keys() - self._mapped):
            messages.append((("segment", index, live[index].nbytes, live[index].pinned), live[index].fd))
            self.segments_sent += 1
        if self._mapped - live.keys():
            messages.append((("forget", sorted(self._mapped - live.keys())), None))
        self._mapped = set(live)
        return messages

    def _replace(self) -> int | None:
        """After a failed send: a writer that took part of a message is of no further use. Killed, so that the next
        save starts another (:class:`.background.BackgroundSaves`); returns its exit code."""
        self.process.kill()
        return self.process.wait()

    def _send_all(self, messages: list[tuple[tuple, int | None]]) -> None:
        try:
            for message, fd in messages:
                self._send(message)
                if fd is not None:
                    sendfds(self._socket, [fd])
        except Exception as error:  # the writer is gone or broken: the save fails when its answer is taken
            self._send_error = error

    def done(self, blocking: bool) -> bool:
        """Whether the save sent last is written (or failed); with ``blocking``, wait for it."""
        if not self.busy or blocking:
            return True
        if self._sender is not None and self._sender.is_alive():
            return False
        return self._send_error is not None or self._connection.poll()

    def answer(self) -> Any:
        """The write results of the save sent last (or the exception it raised), waiting for them."""
        assert self.busy
        if self._sender is not None:
            self._sender.join()
        self.busy = False
        self.last_write = {}
        if self._send_error is not None:
            code = self._replace()
            return RuntimeError(f"handing the save to the checkpoint writer process (pid {self.process.pid}, exit code "
                                f"{code}) failed: {self._send_error!r}")  # fmt: skip
        try:
            answer, started, written, ready = pickle.loads(self._connection.recv_bytes())
        except (EOFError, OSError):
            code = self.process.wait()
            return RuntimeError(f"the checkpoint writer process (pid {self.process.pid}) exited with code {code}")
        except Exception as error:  # an answer that does not unpickle: still this save's failure on this rank
            return RuntimeError(f"the checkpoint writer process's answer could not be read: {error!r}")
        self.last_write = {"writer_wait_s": started - self._handed, "write_s": written - started,
                           "writer_start_s": ready - self._spawned}  # fmt: skip
        return answer

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self, kill: bool = False) -> None:
        """Stop the writer: at once with ``kill`` or while it still writes a save (whose answer nobody takes), else
        once it has finished what it was sent."""
        kill = kill or self.busy
        if kill and self.alive:
            self.process.kill()  # (also ends a handoff blocked on a writer that does not read)
        if self._sender is not None:
            self._sender.join()
        if not kill and self.alive:
            try:
                self._send(("exit",))
                self.process.wait(timeout=_EXIT_WAIT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.alive:
            self.process.kill()
        self._connection.close()
        self._socket.close()
        self.process.wait()

    def _send(self, message: tuple) -> None:
        self._connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


@contextlib.contextmanager
def children_ignore_sigterm() -> Iterator[None]:
    """Processes started in here -- the writer process, the manager process of Megatron's result queue -- inherit
    SIGTERM blocked (also through ``exec``), so a SIGTERM sent to the whole job (as schedulers do) leaves them running:
    the rank stops at its next step (training/preemption.py) and can still publish the save. This process gets the
    signal as usual (another of its threads takes it while the main thread blocks it, or it arrives at the unblock)."""
    if threading.current_thread() is not threading.main_thread():  # then Python cannot block signals
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_LIVE: weakref.WeakSet[WriterProcess] = weakref.WeakSet()


def _close_in_child() -> None:
    """In a process forked from this one (a data loader worker, ...): close its copy of the writers' connections, so
    that the writer sees the connection end when the training process does."""
    for writer in list(_LIVE):
        with contextlib.suppress(OSError):
            writer._connection.close()
            writer._socket.close()


os.register_at_fork(after_in_child=_close_in_child)


def _describe(tensor: torch.Tensor, shared: SharedSegments) -> Any:
    where = shared.locate(tensor)
    if where is None:
        # Its bytes, not the tensor: torch pickles a tensor's storage through torch.storage._load_from_bytes, which
        # megatron.core's __init__ replaces with a function of megatron.core.safe_globals -- whose import (Megatron's
        # models) the writer leaves out, and would pay in the middle of a save.
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        return ("bytes", flat.view(torch.uint8).numpy().tobytes(), tuple(tensor.shape), tensor.dtype)
    return ("shared", *where, tuple(tensor.shape), tensor.dtype)


def _rebuild(description: Any, views: dict[int, Any]) -> torch.Tensor:
    if description[0] == "bytes":
        _, data, shape, dtype = description
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
    _, segment, offset, shape, dtype = description
    return tensor_at(views[segment], offset, shape, dtype)


def serve(parent: int, descriptor: int) -> None:
    """The writer's loop: map segments, write saves, answer, until the training process (``parent``) asks it to
    exit or dies."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(parent)  # a rank killed mid-save: its writer must not go on writing into a directory reused later
    torch.serialization.set_crc32_options(False)  # our block checksums cover the shards (saving._without_zip_crc32)
    channel = socket.socket(fileno=descriptor)
    connection = Connection(os.dup(descriptor))
    views: dict[int, Any] = {}
    ready = time.monotonic()
    trouble: str | None = None  # a message the writer could not act on: the next save's answer names it
    while True:
        message = _next_message(connection, parent)
        if message is None or message[0] == "exit":
            return
        try:
            if message[0] == "segment":
                views[message[1]] = map_segment(recvfds(channel, 1)[0], message[2], message[3])
            elif message[0] == "forget":
                for index in message[1]:
                    views.pop(index, None)
            elif message[0] == "write":
                connection.send_bytes(_write_save(message, views, trouble, ready))
                trouble = None
            else:
                trouble = f"an unreadable message ({message[1]})"
        except Exception as error:
            trouble = f"its {message[0]!r} message failed: {type(error).__name__}: {error}"


def _next_message(connection: Connection, parent: int) -> tuple | None:
    """The next message, or None once the connection ended or the training process died. Processes it forked
    (data loader workers, ...) may hold its end of the connection, so its death need not end the connection."""
    try:
        while not connection.poll(_PARENT_CHECK_S):
            if os.getppid() != parent:
                return None
        data = connection.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        return pickle.loads(data)
    except Exception as error:
        return ("unreadable", f"{type(error).__name__}: {error}")


def _write_save(message: tuple, views: dict[int, Any], trouble: str | None, ready: float) -> bytes:
    """Write one save; the answer (Megatron's write results, or the error) pickled, with when the write began and
    ended and when the writer was ``ready`` to serve."""
    import queue

    _, function, rank, plan = message
    started = time.monotonic()
    results: queue.Queue = queue.Queue()
    try:
        if trouble is not None:
            raise RuntimeError(f"the writer process could not go on: {trouble}")
        buckets = [(path, key, (data, [(item, _rebuild(d, views)) for item, d in tensors]))
                   for path, key, (data, tensors) in plan]  # fmt: skip
        function(rank, buckets, results)
        del buckets
        answer = results.get_nowait()
    except Exception as error:  # answered, not raised: the training process names it
        answer = RuntimeError(f"{type(error).__name__}: {error}")
    written = time.monotonic()
    try:
        return pickle.dumps((answer, started, written, ready), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an exception that does not pickle
        return pickle.dumps((RuntimeError(repr(answer)), started, written, ready))


def _die_with(parent: int) -> None:
    """Have the kernel kill this process (SIGKILL, which it cannot block) when its parent dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call
        os._exit(1)
