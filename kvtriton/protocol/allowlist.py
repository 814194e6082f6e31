"""Which peers a decode engine may meet: addresses and engine ids from requests are untrusted.

``kv_transfer_params`` come from a proxy, and from any client that can reach a decode engine's
API, so the address they name is where an attacker would like the decode to connect. A
:class:`PeerAllowlist` is checked before any connection is made.

Entries (strings):

* ``"10.0.0.7"``, ``"::1"``: one IP address, any port;
* ``"10.0.0.0/24"``, ``"fd00::/64"``: a network (:mod:`ipaddress`), any port;
* ``"10.0.0.7:5710"``, ``"[::1]:5710"``, ``"prefill-0.svc:5710"``: one address and port;
* ``"prefill-0.svc"``: a host name, matched literally (case-insensitive, never resolved: a name
  in a request is compared with the names listed, so DNS cannot widen the list);
* ``"engine:<id>"``: an engine id.

A peer is allowed when its address matches an address entry (if any are listed) **and** its
engine id matches an engine entry (if any are listed). An empty list allows every peer.

Example
-------
>>> allow = PeerAllowlist(["10.0.0.0/24", "engine:prefill-a"])
>>> allow.allows("prefill-a", "10.0.0.9", 5710), allow.allows("prefill-a", "10.0.1.9", 5710)
(True, False)
>>> allow.allows("other", "10.0.0.9", 5710)
False
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from ..errors import KVTritonError

__all__ = ["PeerAllowlist", "AllowlistError"]

_Net = ipaddress.IPv4Network | ipaddress.IPv6Network


class AllowlistError(KVTritonError, ValueError):
    """An ``allowed_peers`` entry is not an address, network, host:port or ``engine:<id>``."""


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6]:port or [v6]
        host, _, rest = entry[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise AllowlistError(f"allowed_peers entry {entry!r}: expected [address]:port")
        return host, _port(entry, rest[1:]) if rest else None
    if entry.count(":") == 1:  # host:port (a bare IPv6 address has several colons)
        host, _, port = entry.partition(":")
        return host, _port(entry, port)
    return entry, None


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise AllowlistError(f"allowed_peers entry {entry!r}: port {text!r} is not a TCP port (1..65535)")
    return int(text)


def _ip(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class PeerAllowlist:
    """Parsed ``allowed_peers``; :meth:`allows` says whether a request's peer may be met."""

    def __init__(self, entries: Iterable[str] = ()):
        self._nets: list[_Net] = []
        self._hosts: set[tuple[str, int | None]] = set()  # (name or canonical ip, port or None)
        self._engines: set[str] = set()
        for entry in entries:
            if not isinstance(entry, str) or not entry.strip():
                raise AllowlistError(f"allowed_peers entry {entry!r}: expected a non-empty string")
            entry = entry.strip()
            if entry.startswith("engine:"):
                if not entry[7:]:
                    raise AllowlistError(f"allowed_peers entry {entry!r}: expected engine:<engine id>")
                self._engines.add(entry[7:])
                continue
            if "/" in entry:
                try:
                    self._nets.append(ipaddress.ip_network(entry, strict=False))
                except ValueError as e:
                    raise AllowlistError(f"allowed_peers entry {entry!r}: not a network ({e})") from None
                continue
            host, port = _split_port(entry)
            if not host:
                raise AllowlistError(f"allowed_peers entry {entry!r}: expected a host before the port")
            ip = _ip(host)
            self._hosts.add((str(ip) if ip is not None else host.lower(), port))

    @property
    def empty(self) -> bool:
        return not (self._nets or self._hosts or self._engines)

    def allows(self, engine_id: str, host: str, port: int) -> bool:
        if self._engines and engine_id not in self._engines:
            return False
        if not (self._nets or self._hosts):
            return True
        ip = _ip(host)
        key = str(ip) if ip is not None else host.lower()
        if (key, None) in self._hosts or (key, port) in self._hosts:
            return True
        return ip is not None and any(ip.version == n.version and ip in n for n in self._nets)

    def __repr__(self) -> str:
        return f"PeerAllowlist(networks={len(self._nets)}, hosts={len(self._hosts)}, engines={len(self._engines)})"
