"""The benchmarks: one module per benchmark, ``python -m bench.<name>`` from the checkout
(``python bench/<name>.py`` runs the same module: :mod:`bench._as_module`). ``bench.sweep``
orchestrates them; ``bench.report`` writes what they measured."""
