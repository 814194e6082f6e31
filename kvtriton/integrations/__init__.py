"""Serving-engine adapters over kvtriton's public API (``TransferAgent``, ``Region``).

Each engine has its own subpackage (``kvtriton.integrations.vllm``); importing ``kvtriton`` never
imports an engine, and an adapter imports only the engine's public connector API.
"""
