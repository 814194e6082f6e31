"""Code the test modules share (no test module imports another): harnesses, fixtures, small
builders. ``tests/`` is on ``sys.path`` (``tests/conftest.py`` puts it there), so a test module
imports ``helpers.<name>``."""
