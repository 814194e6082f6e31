"""``python -m kvtriton``: the ``kvtriton`` command (:mod:`kvtriton.cli`)."""

from .cli import main

if __name__ == "__main__":  # importing this module (pkgutil walks, doctests) runs nothing
    raise SystemExit(main())
