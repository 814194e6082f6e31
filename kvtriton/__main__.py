"""``python -m kvtriton``: the ``kvtriton`` command (:mod:`kvtriton.cli`)."""

from .cli import main

raise SystemExit(main())
