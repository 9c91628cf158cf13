"""torch_p2p inside SGLang: a PD-disaggregation transfer backend named ``torch_p2p``.

SGLang runs ``register`` from the ``sglang.srt.plugins`` entry point (declared by
``pip install -e ".[sglang]"``) before it parses the server's arguments and again in every
scheduler subprocess, so a user needs only the flag:

    --disaggregation-mode prefill|decode --disaggregation-transfer-backend torch_p2p

SGLang's list of backends is closed (the ``TransferBackend`` enum, ``get_kv_class``): the plugin
adds one enum member and wraps ``get_kv_class`` for it through SGLang's ``HookRegistry``, which
also rebinds the copies that ``prefill``, ``decode``, ``scheduler`` and ``disagg_service`` took
with ``from ... import get_kv_class``; every other backend is left as it was.
"""
from __future__ import annotations

BACKEND = "torch_p2p"
_CLASSES = {"manager": "TorchP2PKVManager", "sender": "TorchP2PKVSender", "receiver": "TorchP2PKVReceiver",
            "bootstrap_server": "TorchP2PKVBootstrapServer"}


def register() -> None:
    """Adds the backend to SGLang (its argument choices, its enum, its class lookup). Safe to
    call more than once: SGLang loads plugins once a process, tests may call it again."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    if BACKEND in TransferBackend._value2member_map_:
        return
    _add_enum_member(TransferBackend, BACKEND.upper(), BACKEND)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND)


def _get_kv_class(original, transfer_backend, class_type):
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or class_type.value == "kvargs":
        return original(transfer_backend, class_type)
    from . import conn

    return getattr(conn, _CLASSES[class_type.value])


def _add_enum_member(enum_cls, name: str, value: str) -> None:
    # Enum has no public way to grow; these are the tables its lookups read (by value:
    # TransferBackend("torch_p2p"); by name; iteration), as the enum module fills them.
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
