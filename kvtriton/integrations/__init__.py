"""Serving-engine adapters over kvtriton's public API (``TransferAgent``, ``Region``).

Each engine has its own subpackage (``kvtriton.integrations.vllm``, ``kvtriton.integrations.sglang``);
what they share is here: :mod:`.settings` (the keys both engines read) and :mod:`.core` (the agent
those settings make, and a decode rank's meeting of a prefill engine). Importing ``kvtriton`` never
imports an engine, and an adapter imports only the engine's public connector API.
"""
