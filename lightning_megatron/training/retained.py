"""What a finished run keeps so that ``trainer.save_checkpoint`` works after it, as after any Lightning ``fit``.

Lightning keeps the optimizer after ``fit`` (moving its state to the CPU at teardown), and users save the final
model with ``trainer.save_checkpoint(path)``. A Megatron checkpoint also needs Megatron's process groups (the
sharded state dicts ask them for ranks) and, on CPU, CPU mode. So after a run the strategy keeps its groups and
its optimizer; on GPU the optimizer state (and gradient buffers) leave the accelerator for pinned host memory, and
come back only while a save after the run writes them.

A run Lightning never tore down (a callback raised in ``on_exception``) is torn down when the next one starts
(:func:`run_started`), so that its patches and SIGTERM handler do not outlive it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from lightning_megatron.compat import cpu
from lightning_megatron.parallel import state
from lightning_megatron.parallel.state import Groups
from lightning_megatron.training.offload import Offloaded, offload, reload

log = logging.getLogger(__name__)


class Retained:
    """The state of a finished run that a later ``save_checkpoint`` needs (see the module docstring)."""

    def __init__(self, groups: Groups, device_type: str) -> None:
        self.groups = groups
        self.device_type = device_type
        self.on_host: Offloaded | None = None
        """Optimizer state and gradients moved off the GPU; ``None`` on CPU or when nothing was moved."""

    def keep(self, chunks: Iterable[nn.Module], optimizer: Any | None) -> None:
        """Move the optimizer's state off the GPU (once; a no-op on CPU or without an optimizer)."""
        if optimizer is not None and self.device_type == "cuda" and self.on_host is None:
            self.on_host = offload(chunks, optimizer, params=False, grads=True, optimizer_state=True)

    def forget_optimizer(self) -> None:
        """A new optimizer replaces the kept one: its host copies are no longer needed."""
        self.on_host = None

    @contextlib.contextmanager
    def restored(self, chunks: Iterable[nn.Module], optimizer: Any | None) -> Iterator[None]:
        """Megatron's state as during the run, for the duration of a save."""
        if not self.groups.alive():
            raise RuntimeError(
                "trainer.save_checkpoint after this run: another run has replaced its Megatron process groups since; "
                "save before starting the next fit/validate/test/predict"
            )
        chunks = list(chunks)
        with cpu.cpu_mode() if self.device_type == "cpu" else contextlib.nullcontext():
            if self.on_host is not None:
                reload(self.on_host)
                self.on_host = None
            try:
                yield
            finally:
                self.keep(chunks, optimizer)


def keep_after_run(
    retained: Retained | None, groups: Groups | None, device_type: str, module: Any, optimizer: Any
) -> Retained | None:
    """At a run's teardown: what it keeps for a later ``save_checkpoint`` (its groups, and the optimizer of
    ``module``'s chunks moved off the GPU), or, without ``groups`` (a failed run, whose peers may be gone, or one that
    failed before its chunks existed), nothing: Megatron's state is destroyed."""
    if groups is None:
        state.destroy()
        return None
    retained = retained or Retained(groups, device_type)
    retained.keep(module.chunks, optimizer)
    return retained


def run_all(*steps: Callable[[], object], raise_errors: bool = True) -> None:
    """Run every step (teardown's): one that raises does not stop the rest. The first error is re-raised at the
    end, or, with ``raise_errors=False`` (teardown after a failure, whose exception Lightning is raising), logged."""
    error: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as caught:  # noqa: BLE001  (KeyboardInterrupt included: the rest must still run)
            error = error or caught
    if error is not None and raise_errors:
        raise error
    if error is not None:
        log.error("teardown after a failed run also failed: %s: %s", type(error).__name__, error, exc_info=error)


# Runs started and not torn down, with their SIGTERM handling (held strongly: their patches must be undone even if
# nothing else holds the strategy).
_UNFINISHED: dict[int, tuple[Any, Any]] = {}


def run_started(strategy: Any, sigterm: Any) -> None:
    """At a run's start: first tear down the runs Lightning left unfinished -- an earlier run of ``strategy``, or one
    whose Trainer ended interrupted: when a callback raises in ``on_exception`` (e.g.
    ``ModelCheckpoint(save_on_exception=True)`` failing to save) Lightning skips the strategy's ``on_exception`` and
    the teardown, which run here, with the SIGTERM handler from before that run put back (not Lightning's: its own
    teardown will not run). A run still going (a Trainer inside another's callback) is left alone. Then record this
    run and start its SIGTERM handling (``sigterm``: its ``SigtermStop``, :mod:`.preemption`)."""
    for other, other_sigterm in list(_UNFINISHED.values()):
        if other is strategy or interrupted(other.lightning_module):
            other_sigterm.restore_chained()
            other.on_exception(RuntimeError("a callback raised in on_exception: Lightning did not end this run"))
            other.teardown()
    _UNFINISHED[id(strategy)] = (strategy, sigterm)
    sigterm.before_run()


def run_finished(strategy: Any) -> None:
    """At a run's teardown."""
    _UNFINISHED.pop(id(strategy), None)


def interrupted(module: Any) -> bool:
    """Whether ``module``'s Trainer ended its last run in an exception (Lightning's status INTERRUPTED)."""
    from lightning.pytorch.trainer.states import TrainerStatus

    try:
        return module.trainer.state.status == TrainerStatus.INTERRUPTED
    except (AttributeError, RuntimeError):  # no module, or one no longer attached to a Trainer
        return False
