"""kvtriton as an SGLang disaggregation transfer backend: ``--disaggregation-transfer-backend kvtriton``.

``pip install kvtriton`` installs the ``sglang.srt.plugins`` entry point (``pyproject.toml``) that
:func:`.plugin.register` answers in every SGLang process: it adds the ``kvtriton`` choice, the
``TransferBackend.KVTRITON`` member and the classes ``get_kv_class`` returns for it
(:mod:`.conn`). ``import kvtriton`` never imports SGLang, and neither does importing this package,
:mod:`.plugin` or :mod:`.settings`; :mod:`.conn` (the manager, sender, receiver and bootstrap
server, built on SGLang's ``Common*`` classes) is imported only when SGLang asks for the classes.
See docs/sglang.md.
"""

__all__ = ["BACKEND"]

BACKEND = "kvtriton"
