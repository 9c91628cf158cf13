"""Control messages of torch_p2p.weights: JSON objects over engine.send, bytes as base64.

JSON and not pickle: the fabric does not authenticate senders, so a message must not be able
to run code. Every message has a "kind"; a malformed one raises ValueError and is dropped.

    source rank > 0 -> leader   hello(rank, layout)
    destination -> leader       join(name, layout, remotes), leave(member), ready(v, member),
                                have(v, member)
    leader -> destination       joined(member, sources, chunk_bytes) | refused(problems),
                                left(busy), begin(v), route(v, group, position, fanout, members),
                                ping()
    leader -> other sources     go(v, groups, fanout, sources, members), done(v, received,
                                dropped), failed(v, error), ping()
    anyone -> leader            drop(v, member, reason)
    leader -> everyone in v     dropped(v, member, reason)
    adopting parent <-> child   want(v) -> lacking(v, member, chunks)
"""
from __future__ import annotations

import json

from .._shared import b64, unb64

VERSION_BITS, CHUNK_BITS = 12, 20


def tag(version: int, chunk: int) -> int:
    """The notification tag of a chunk of a version. The version's low bits keep a late arrival
    of one version from completing the wait of the next."""
    return ((version & ((1 << VERSION_BITS) - 1)) << CHUNK_BITS) | chunk


def _default(value):
    if isinstance(value, (bytes, bytearray)):
        return {"b64": b64(value)}
    raise TypeError(f"cannot encode {type(value).__name__}")


def _hook(d: dict):
    return unb64(d["b64"]) if d.keys() == {"b64"} else d


def encode(kind: str, **fields) -> bytes:
    return json.dumps({"kind": kind, **fields}, default=_default).encode()


def decode(payload: bytes) -> dict:
    try:
        msg = json.loads(payload, object_hook=_hook)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not a weights message: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("kind"), str):
        raise ValueError("not a weights message: no kind")
    return msg


def member_info(member) -> dict:
    """What a process needs to write into a destination: its id, name, address, layout, handles."""
    return {"id": member.id, "name": member.name, "address": member.address, "layout": member.layout.to_json(),
            "remotes": {name: r.to_bytes() for name, r in member.remotes.items()}}
