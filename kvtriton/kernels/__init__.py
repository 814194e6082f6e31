"""Triton kernels (pure data movement, no policy). Installed as ``kvtriton.kernels``."""
