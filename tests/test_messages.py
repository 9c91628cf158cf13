"""The control messages' wire format (csrc/core/messages.h, and the staged route's own in
csrc/routes/staged/messages.h) without an engine: each body laid out here by hand, field by
field, read by the engine's decoder and written back by its encoder."""
import struct

import pytest

from torch_p2p import _C

MAGIC, VERSION = 0x4D503250, 1
SENDER, RECEIVER = 0x1111222233334444, 0x5555666677778888
PEER_ERROR = next(k for k, name in _C.error_kinds.items() if name == "PeerError")


def header(kind, sender=SENDER, receiver=RECEIVER):
    return struct.pack("<IBBQQ", MAGIC, VERSION, kind, sender, receiver)


def blob(data):
    return struct.pack("<I", len(data)) + data


LIVE = struct.pack("<QH", 9, 2) + struct.pack("<QQ", 1, 3) + struct.pack("<QQ", 7, 9)
LIVE_FIELDS = {"upto": 9, "ranges": [(1, 3), (7, 9)]}
STAGE = (struct.pack("<QBQQH", 21, 1, 5, 96, 2) + struct.pack("<QQ", 0xA0, 0xB0) + struct.pack("<QQ", 0xA1, 0xB1)
         + struct.pack("<Q", 0xC0) + struct.pack("<H", 2) + struct.pack("<QI", 0, 64) + struct.pack("<QI", 4096, 32))

CASES = {
    "hello": (1, blob(b"an address") + LIVE, {"address": b"an address", **LIVE_FIELDS}),
    "hello_ack": (2, blob(b"an address") + struct.pack("<Q", 77) + LIVE,
                  {"address": b"an address", "expected": 77, **LIVE_FIELDS}),
    "bye": (3, b"\x01", {"closing": True}),
    "user": (6, struct.pack("<IQQ", 5, 10, 4) + blob(b"abcdef"), {"id": 5, "total": 10, "offset": 4, "part": b"abcdef"}),
    "notify": (7, struct.pack("<IB", 42, PEER_ERROR) + blob(b"gone"), {"id": 42, "kind": PEER_ERROR, "message": b"gone"}),
    "region_closed": (10, struct.pack("<Q", 12), {"id": 12}),
    "region_released": (11, struct.pack("<Q", 13), {"id": 13}),
    "user_ack": (14, struct.pack("<I", 16), {"id": 16}),
    "route": (15, struct.pack("<B", 1) + blob(b"body"), {"route": 1, "body": b"body"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_message_reads_its_fields_and_writes_the_same_bytes(name):
    kind, body, fields = CASES[name]
    data = header(kind) + body
    got_kind, sender, receiver, got, again = _C._decode_message(data)
    assert (got_kind, sender, receiver) == (kind, SENDER, RECEIVER)
    assert got == fields
    assert again == data


@pytest.mark.parametrize("data, why", [
    (header(99), "unknown message type"),
    (header(4), "unknown message type"),  # retired (Ping)
    (header(8) + STAGE, "unknown message type"),  # retired: the staged route's messages are Route ones
    (header(12) + struct.pack("<Q", 1), "unknown message type"),  # retired: so are the fabric route's
    (header(16), "unknown message type"),
    (header(7) + struct.pack("<IB", 1, 200) + blob(b""), "bad status"),
    (header(6) + struct.pack("<IQQ", 1, (1 << 30) + 1, 0) + blob(b""), "message too large"),
    (header(10) + b"\x01\x02", "truncated"),
    (struct.pack("<I", 0xDEADBEEF) + header(10)[4:] + struct.pack("<Q", 1), "bad magic"),
    (header(7) + struct.pack("<IB", 1, 0) + struct.pack("<I", 9000), "longer than allowed"),
])
def test_malformed_messages_are_refused(data, why):
    with pytest.raises(ValueError, match=why):
        _C._decode_message(data)


# Route messages' bodies: a kind byte, then the fields. The staged route's request and answer;
# the fabric route's Fence and FenceAck (a transfer id) and KeepPolling (nothing).
ROUTE_CASES = {
    "stage_request": (_C._decode_stage_message, 3, STAGE,
                      {"request": 21, "dir": 1, "region": 5, "bytes": 96, "base": [0xA0, 0xA1], "key": [0xB0, 0xB1],
                       "slot": 0xC0, "runs": [(0, 64), (4096, 32)]}),
    "stage_ack": (_C._decode_stage_message, 4, struct.pack("<QB", 21, 0) + blob(b""),
                  {"id": 21, "kind": 0, "message": b""}),
    "fence": (_C._decode_fabric_message, 1, struct.pack("<Q", 14), {"transfer": 14}),
    "fence_ack": (_C._decode_fabric_message, 2, struct.pack("<Q", 15), {"transfer": 15}),
    "keep_polling": (_C._decode_fabric_message, 3, b"", {"transfer": 0}),
}


@pytest.mark.parametrize("name", sorted(ROUTE_CASES))
def test_each_route_message_reads_its_fields_and_writes_the_same_bytes(name):
    decode, kind, body, fields = ROUTE_CASES[name]
    data = bytes([kind]) + body
    assert decode(data) == (kind, fields, data)


@pytest.mark.parametrize("decode, data, why", [
    (_C._decode_stage_message, bytes([3]) + struct.pack("<QBQQH", 1, 2, 0, 0, 0), "bad stage request"),
    (_C._decode_stage_message, bytes([4]) + struct.pack("<QB", 1, 200) + blob(b""), "bad status"),
    (_C._decode_stage_message, bytes([3]) + STAGE + b"\x00", "trailing bytes"),
    (_C._decode_stage_message, bytes([9]) + STAGE, "not a staged request"),
    (_C._decode_fabric_message, bytes([1]) + b"\x01\x02", "truncated"),
    (_C._decode_fabric_message, bytes([3, 0]), "trailing bytes"),
    (_C._decode_fabric_message, bytes([9]) + struct.pack("<Q", 1), "unknown kind"),
])
def test_malformed_route_messages_are_refused(decode, data, why):
    with pytest.raises(ValueError, match=why):
        decode(data)
