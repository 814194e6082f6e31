"""SGLang plugin: the ``kvtriton`` choice of ``--disaggregation-transfer-backend``.

SGLang 0.5.23 picks a backend from a closed ``TransferBackend`` enum and an if-chain in
``get_kv_class`` (``sglang/srt/disaggregation/utils.py``); it has no registry. What it has is a
plugin loader (``sglang.srt.plugins.load_plugins``, called in every process before the arguments
are parsed) and an extension point for the CLI choices (``add_disagg_transfer_backend_choices``).
:func:`register` uses both and SGLang's own ``HookRegistry``:

* the choice ``kvtriton`` is added to the argument's choices;
* ``TransferBackend.KVTRITON`` (value ``"kvtriton"``) is added to the enum, so
  ``TransferBackend(server_args.disaggregation_transfer_backend)`` resolves it;
* an AROUND hook on ``get_kv_class`` answers for that member (the ``Common*``-based classes of
  :mod:`.conn`, imported only then) and passes every other backend to SGLang's own code.
  HookRegistry also rebinds the name in every module that imported it with ``from ... import``.

``SGLANG_PLUGINS`` (comma-separated plugin names) limits which plugins load; leaving ``kvtriton``
out of it turns this off. Idempotent: SGLang loads plugins once per process, a test may call it
again.
"""

from __future__ import annotations

from . import BACKEND

__all__ = ["BACKEND", "MEMBER", "register"]

MEMBER = "KVTRITON"
_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


def _add_member(enum_cls) -> None:
    """Add ``KVTRITON = "kvtriton"`` to SGLang's closed ``TransferBackend`` enum (once)."""
    if BACKEND in enum_cls._value2member_map_:
        return
    member = object.__new__(enum_cls)
    member._name_ = MEMBER
    member._value_ = BACKEND
    enum_cls._member_map_[MEMBER] = member
    enum_cls._value2member_map_[BACKEND] = member
    enum_cls._member_names_.append(MEMBER)
    type.__setattr__(enum_cls, MEMBER, member)


def _get_kv_class(original, transfer_backend, class_type):
    """``get_kv_class`` with the ``kvtriton`` backend answered here, every other one by SGLang."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    from . import conn

    if class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)  # every backend shares SGLang's KVArgs
    return {
        KVClassType.MANAGER: conn.KVTritonKVManager,
        KVClassType.SENDER: conn.KVTritonKVSender,
        KVClassType.RECEIVER: conn.KVTritonKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KVTritonKVBootstrapServer,
    }.get(class_type)


_registered = False


def register() -> bool:
    """Add the backend to SGLang (see the module docstring); ``True`` when this call did."""
    global _registered
    if _registered:
        return False
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _add_member(TransferBackend)
    HookRegistry.register(_TARGET, _get_kv_class, HookType.AROUND)
    # load_plugins applies hooks after every plugin ran; a direct call (a test, an embedding
    # program) applies them now. Targets already patched are skipped, so this is safe twice.
    HookRegistry.apply_hooks()
    _registered = True
    return True
