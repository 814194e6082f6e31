"""vLLM plugin: registers ``KVTritonConnector`` with vLLM's connector factory.

``pip install kvtriton`` installs the ``vllm.general_plugins`` entry point ``kvtriton`` (see
``pyproject.toml``), which vLLM calls in every process it starts (API server, engine core,
workers) before it builds a connector, so ``--kv-transfer-config
'{"kv_connector": "KVTritonConnector", ...}'`` finds the connector by name, with no
``kv_connector_module_path`` (which keeps working: vLLM imports a module path first). vLLM's
``VLLM_PLUGINS`` (a comma-separated list of plugin names) limits which plugins load; leaving
``kvtriton`` out of it turns this off.

Registration is lazy, as vLLM's own connectors are: the factory keeps the module path and class
name, and imports the connector (and with it NIXL and the agent) only when an engine asks for it.
Importing this module imports nothing of vLLM; :func:`register` imports only the factory.
"""

from __future__ import annotations

__all__ = ["CONNECTOR", "MODULE", "register"]

CONNECTOR = "KVTritonConnector"
MODULE = "kvtriton.integrations.vllm.connector"


def register() -> bool:
    """Register the connector with vLLM's ``KVConnectorFactory``; ``True`` when this call did.

    Idempotent: vLLM may load general plugins more than once in a process (its docs say plugins
    must allow it), and another copy of kvtriton may have registered first; the factory raises
    on a second registration of a name, so a name already present is left as it is."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR, MODULE, CONNECTOR)
    except ValueError as e:
        if "already registered" not in str(e):
            raise
        return False
    return True
