"""kvtriton as a vLLM KV connector: ``kv_connector_module_path="kvtriton.integrations.vllm"``,
``kv_connector="KVTritonConnector"`` (see :mod:`.connector`).

``import kvtriton`` never imports vLLM, and neither does importing this package: the connector
class (and with it vLLM) is loaded on first access, which is how vLLM's loader reaches it
(``getattr(module, "KVTritonConnector")``). The scheduler and worker logic, the cache translation
and the settings import no vLLM at all.
"""

__all__ = ["KVTritonConnector", "KVTritonMetadata"]


def __getattr__(name: str):
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
