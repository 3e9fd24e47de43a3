"""Runs ``dask worker ARGS...`` in an interpreter where dask-otel cannot be imported, as
on a host where it is not installed.

Start it with ``python -S``: no ``.pth`` file of site-packages runs, so neither does the
import hook of an editable install, and ``SITE_PACKAGES`` (directories joined by
``os.pathsep``) goes on ``sys.path`` by hand: the test passes shadows of site-packages
that hold everything installed there but dask-otel. The Nanny's worker process inherits
both (multiprocessing passes on ``-S`` and ``sys.path``). Should dask-otel still be
importable, the script refuses to run rather than pretend.
"""

from __future__ import annotations

import importlib.util
import os
import sys

if __name__ == "__main__":
    if not sys.flags.no_site:
        sys.exit("without_dask_otel.py: start it with python -S")
    sys.path.extend(os.environ["SITE_PACKAGES"].split(os.pathsep))
    if importlib.util.find_spec("dask_otel") is not None:
        sys.exit("without_dask_otel.py: dask_otel is importable from SITE_PACKAGES")
    from distributed.cli.dask_worker import main

    sys.argv = ["dask worker", *sys.argv[1:]]
    main()
