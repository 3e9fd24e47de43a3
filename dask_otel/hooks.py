"""dask-otel's hooks into Dask, each waiting for the import of the module it needs.

``opentelemetry-instrument`` loads dask-otel's instrumentor in every Python process it
starts (its sitecustomize is on ``PYTHONPATH``): multiprocessing's children and resource
tracker, any tool a traced program runs. A process that never imports ``distributed``
must start as fast as plain Python and never import it (nor numpy through it), and a
program that configures logging before importing ``distributed`` must still decide how
Dask's records look (``distributed`` sets up its logging when it is imported). So the
patches of :mod:`dask_otel.patches` are applied right after ``distributed`` is imported,
however that happens (``import distributed``, ``from dask.distributed import Client``,
``dask worker``, unpickling a Nanny's worker), or at once if it already was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

from wrapt import register_post_import_hook

from dask_otel import runtime
from dask_otel.runtime import report_once
from dask_otel.runtime_state import ProcessState

logger = logging.getLogger(__name__)


class Patching(ProcessState):
    """Whether this process wants dask-otel's patches of Dask, and whether they are in."""

    def __init__(self) -> None:
        #: :func:`install` was called, and :func:`uninstall` not since.
        self.wanted = False
        #: The patches are applied (``distributed`` was imported while they were wanted).
        self.applied = False


#: The one per process (a forked child keeps its parent's patches).
patching = runtime.own(Patching())


def when_imported(module: str, hook: Callable[[], None]) -> None:
    """Run ``hook`` once ``module`` is imported: at once if it is, else right after its
    import. A hook that fails is reported once and never fails the program's import."""

    def run(_module: ModuleType) -> None:
        try:
            hook()
        except Exception:
            report_once(
                logger, f"hook {hook.__qualname__}", "dask-otel could not hook into %s", module
            )

    register_post_import_hook(run, module)


def install() -> None:
    """Attach dask-otel to every Dask object created from now on (once ``distributed``
    is imported)."""
    patching.wanted = True
    when_imported("distributed", _apply)


def is_installed() -> bool:
    """Whether :func:`install` was called, and :func:`uninstall` not since (hooks that
    run at once are called before the instrumentor counts as instrumented)."""
    return patching.wanted


def _apply() -> None:
    if patching.wanted and not patching.applied:  # install, uninstall, install: once
        from dask_otel import patches

        patches.apply()
        patching.applied = True


def uninstall() -> None:
    """Leave Dask objects created from now on alone."""
    patching.wanted = False
    if patching.applied:
        from dask_otel import patches

        patches.remove()
        patching.applied = False
