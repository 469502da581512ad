"""SIGTERM -- how SLURM, Kubernetes and most schedulers stop or preempt a job -- ends every rank at one step.

Lightning's own SIGTERM handling is not safe for a job whose ranks are bound by collectives: its handler runs a
broadcast inside the signal handler (wherever each rank happens to be), and its loops raise ``SIGTERMException``
at a different point on each rank, so the ranks then wait in different collectives and the job hangs. And its
``SIGTERMException()`` exits with status 0, so a wrapper script thinks the job finished.

While a stage runs, :class:`SigtermStop` replaces that handler with one that only notes the signal (and calls the
handler the user had installed before the run, if any). At every step boundary -- each training batch's start,
each validation/test/predict batch and each stage's end, but not inside a gradient-accumulation window, whose
optimizer step comes first -- all ranks agree on whether any rank got the signal (one all-reduce of a flag over a
gloo group, so no accelerator synchronisation), and if one did, every rank raises :class:`Preempted` there, outside
any collective. Lightning then runs the ``on_exception`` hooks on every rank:
an ``OnExceptionCheckpoint`` or ``ModelCheckpoint(save_on_exception=True)`` writes a final checkpoint (a collective
save that works because every rank is at the same point), and the process exits with status 143 (128 + SIGTERM),
as a process killed by the signal would. A signal after the last check (during teardown) is raised again at the
end of the strategy's teardown where the process had the default action, so it ends the process as it would have.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

EXIT_CODE = 128 + signal.SIGTERM
"""The exit status of a preempted run: what a shell reports for a process the signal killed."""

_Handler = Callable[[int, FrameType | None], Any] | int | None


class Preempted(SIGTERMException):
    """Raised on every rank at the same step boundary after any rank received SIGTERM.

    A ``SystemExit`` (as Lightning's ``SIGTERMException``, which callbacks may look for) with exit status
    :data:`EXIT_CODE`: uncaught, the process ends with that status and no traceback.
    """

    def __init__(self, step: int, ranks: int, world_size: int) -> None:
        super().__init__(EXIT_CODE)
        self.step, self.ranks, self.world_size = step, ranks, world_size

    def __str__(self) -> str:
        return (
            f"SIGTERM received by {self.ranks} of {self.world_size} rank(s): every rank stopped at global step "
            f"{self.step} (that many optimizer steps done), exit status {EXIT_CODE}. Resume from the last "
            "checkpoint (ckpt_path='last'); an OnExceptionCheckpoint or ModelCheckpoint(save_on_exception=True) "
            "callback saves one at this point"
        )


class SigtermStop:
    """Notes SIGTERM while installed; :meth:`check` turns it into :class:`Preempted` on every rank at once.

    The strategy calls :meth:`before_run` at setup, :meth:`at_barrier` at every barrier (Lightning registers its
    handler between its last barrier of the setup and the first of the stage, ``"run-stage"``), :meth:`check` at
    every step boundary and at each stage's end, :meth:`uninstall` at teardown.
    """

    def __init__(self, in_window: Callable[[], bool] = lambda: False) -> None:
        """``in_window``: whether a gradient-accumulation window is open (gradients of its first batches wait in the
        buffers): the stop then waits for the window's optimizer step, as a checkpoint taken inside it would resume
        at the window's next batch with those gradients lost."""
        self.in_window = in_window
        self.received = False
        self._chained: _Handler = None  # the handler in place before Lightning's: still called, and put back last
        self._replaced: _Handler = None  # Lightning's, which ours replaced: put back by uninstall()
        self._active = self._installed = self._raised = False

    def before_run(self) -> None:
        """At the run's setup: remember the handler in place, forget earlier signals."""
        self.received = self._raised = self._installed = False
        self._chained = signal.getsignal(signal.SIGTERM)
        self._active = True

    def at_barrier(self, takeover: bool) -> None:
        """During a run, at a barrier: before ``takeover``, remember the handler in place (a callback's ``setup`` may
        have registered one; Lightning will restore it); at ``takeover`` (the first barrier after Lightning
        registered its handler) replace Lightning's with ours."""
        # Python only lets the main thread set handlers (Lightning skips its own elsewhere, too).
        if not self._active or self._installed or threading.current_thread() is not threading.main_thread():
            return
        if not takeover:
            self._chained = signal.getsignal(signal.SIGTERM)
            return
        self._replaced = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def restore_chained(self) -> None:
        """For a run whose Lightning teardown will not run (it puts back the handler from before Lightning's): put
        back the handler from before the run instead of Lightning's. Call it before :meth:`uninstall`."""
        ours = self._installed and signal.getsignal(signal.SIGTERM) == self._handle
        if ours and self._chained is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._chained)  # type: ignore[arg-type]
            self._installed, self._replaced = False, None

    def uninstall(self, redeliver: bool = True) -> None:
        """Put back Lightning's handler (Lightning's teardown then restores the one from before it). A signal that
        came after the last :meth:`check` is not dropped: with ``redeliver`` and the default action before the run,
        it is raised again here, at the end of the strategy's teardown, and ends the process as the default action
        would have (before Lightning's own teardown and the ``teardown``/``on_fit_end`` hooks)."""
        self._active = False
        if self._installed:
            self._installed = False
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self._replaced)  # type: ignore[arg-type]
            self._replaced = None
        if redeliver and self.received and not self._raised and self._chained == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # No collective, no logging here: the main thread may be anywhere, inside a collective included.
        self.received = True
        if callable(self._chained):
            self._chained(signum, frame)

    def check(self, group: Any | None, step: int) -> None:
        """Collective over ``group`` (every rank, at the same step boundary): raise :class:`Preempted` on every rank
        if any of them received SIGTERM. One all-reduce of a flag; ``group=None``: this process alone. Inside an
        accumulation window (``in_window``, alike on every rank) nothing is checked: its end is the boundary."""
        if self.in_window():
            return
        count = torch.tensor([int(self.received)], dtype=torch.int32)
        world_size = 1
        if group is not None:
            torch.distributed.all_reduce(count, group=group)
            world_size = torch.distributed.get_world_size(group)
        if int(count.item()) == 0:
            return
        error = Preempted(step, int(count.item()), world_size)
        self._raised = True
        rank_zero_warn(str(error))
        raise error
