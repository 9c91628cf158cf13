"""The torch_p2p transfer backend inside SGLang: every KVPoll transition, bytes checked page by
page, abort on either side, a killed, a frozen and a restarted prefill, TP 2 -> TP 1, MLA, an
incompatible peer. States: Failed 0, Bootstrapping 1, WaitingForInput 2, Transferring 3,
Success 4 (sglang.srt.disaggregation.base.conn.KVPoll)."""
from __future__ import annotations

import os
import signal
import time

from checkout import free_port
from conftest import device

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
SRC, DST = [3, 4, 5, 9, 17, 40], [60, 2, 11, 12, 13, 30]  # pages: runs and gaps on both sides


def bootstrap(prefills, decodes, room, dst=DST, aux_dst=5):
    """Opens the room on every rank and hands decode's pages to prefill; prefill is then waiting."""
    for p in prefills:
        assert p.call("open", room=room)["state"] == BOOTSTRAPPING
    for d in decodes:
        assert d.call("open", room=room)["state"] == BOOTSTRAPPING
        d.call("bootstrap", room=room, timeout=30)
        assert d.call("wait", room=room, states=[WAITING, FAILED], timeout=30)["state"] == WAITING
        d.call("metadata", room=room, pages=dst, aux_index=aux_dst)
    for p in prefills:
        w = p.call("wait", room=room, states=[WAITING, FAILED], timeout=30)
        assert w["state"] == WAITING and w["seen"][0] in (BOOTSTRAPPING, WAITING), w


def transfer(prefills, decodes, room, src=SRC, dst=DST, aux_src=2, aux_dst=5, chunks=2):
    bootstrap(prefills, decodes, room, dst, aux_dst)
    for p in prefills:
        p.call("send", room=room, pages=src, aux_index=aux_src, chunks=chunks)
    for p in prefills:
        w = p.call("wait", room=room, states=[SUCCESS, FAILED], timeout=30)
        assert w["state"] == SUCCESS, (w, p.call("failure", room=room))
        assert set(w["seen"]) <= {WAITING, TRANSFERRING, SUCCESS}, w
    for d in decodes:
        w = d.call("wait", room=room, states=[SUCCESS, FAILED], timeout=30)
        assert w["state"] == SUCCESS, (w, d.call("failure", room=room))
        assert d.call("check", src_pages=src, dst_pages=dst, aux_src=aux_src, aux_dst=aux_dst)["mismatch"] is None
    for r in prefills + decodes:
        r.call("clear", room=room)


def pair(ranks, **opts):
    port = free_port()
    return ranks("prefill", port, device=device(), **opts), ranks("decode", port, device=device(), **opts), port


def test_transitions_and_pages(ranks):
    prefill, decode, _ = pair(ranks)
    transfer([prefill], [decode], room=101)
    # A second request over the same connection, one chunk, other pages.
    transfer([prefill], [decode], room=102, src=list(range(10, 30)), dst=list(range(40, 60)), chunks=1)


def test_mla(ranks):
    prefill, decode, _ = pair(ranks, mla=True)
    transfer([prefill], [decode], room=7)


def test_tp2_prefill_to_tp1_decode(ranks):
    port = free_port()
    prefills = [ranks("prefill", port, tp_size=2, tp_rank=r, device=device()) for r in (0, 1)]
    decode = ranks("decode", port, device=device())
    transfer(prefills, [decode], room=11)


def test_prefill_abort_fails_both_sides(ranks):
    prefill, decode, _ = pair(ranks)
    bootstrap([prefill], [decode], room=21)
    assert prefill.call("abort", room=21)["state"] == FAILED
    assert decode.call("wait", room=21, states=[SUCCESS, FAILED], timeout=30)["state"] == FAILED
    assert "Aborted" in decode.call("failure", room=21)["message"]
    assert prefill.call("failure", room=21)["type"] == "KVTransferError"
    transfer([prefill], [decode], room=22)  # the pair still works


def test_decode_abort_stops_the_prefill_room(ranks):
    prefill, decode, _ = pair(ranks)
    bootstrap([prefill], [decode], room=31)
    decode.call("abort", room=31)
    assert prefill.call("wait", room=31, states=[FAILED], timeout=30)["state"] == FAILED
    transfer([prefill], [decode], room=32)


def test_incompatible_decode_is_refused_by_name(ranks):
    port = free_port()
    prefill = ranks("prefill", port, device=device())
    # SGLang itself refuses another dtype or page size; a head of other size only we see.
    decode = ranks("decode", port, device=device(), head_bytes=16)
    prefill.call("open", room=41)
    decode.call("open", room=41)
    decode.call("bootstrap", room=41, timeout=30)
    decode.call("metadata", room=41, pages=DST, aux_index=1)
    assert decode.call("wait", room=41, states=[SUCCESS, FAILED], timeout=30)["state"] == FAILED
    assert prefill.call("wait", room=41, states=[FAILED], timeout=30)["state"] == FAILED
    message = decode.call("failure", room=41)["message"]
    assert "head_bytes 32 here, 16 there" in message, message


def _dead_prefill(ranks, stop):
    prefill, decode, _ = pair(ranks)
    bootstrap([prefill], [decode], room=51)
    start = time.monotonic()
    stop(prefill.proc.pid)
    w = decode.call("wait", room=51, states=[SUCCESS, FAILED], timeout=40)
    took = time.monotonic() - start
    assert w["state"] == FAILED, w
    assert took < 25, f"decode heard of the dead prefill after {took:.1f} s"
    assert decode.call("failure", room=51)["type"] == "KVTransferError"
    return prefill, decode


def test_killed_prefill_fails_the_room(ranks):
    _dead_prefill(ranks, lambda pid: os.kill(pid, signal.SIGKILL))


def test_frozen_prefill_fails_the_room(ranks):
    prefill, _ = _dead_prefill(ranks, lambda pid: os.kill(pid, signal.SIGSTOP))
    os.kill(prefill.proc.pid, signal.SIGCONT)


def test_restarted_prefill_serves_again(ranks):
    prefill, decode, port = pair(ranks)
    transfer([prefill], [decode], room=61)
    prefill.close()
    # Decode forgets the dead instance (its heartbeat), then talks to the new one.
    reply = decode.call("forget", addr_port=port, timeout=30)
    assert reply["forgotten"], reply
    restarted = ranks("prefill", port, device=device())
    transfer([restarted], [decode], room=62)


def test_metadata_before_the_sender(ranks):
    # Decode's pages may reach prefill before prefill's scheduler creates the sender.
    prefill, decode, _ = pair(ranks)
    decode.call("open", room=71)
    decode.call("bootstrap", room=71, timeout=30)
    decode.call("wait", room=71, states=[WAITING, FAILED], timeout=30)
    decode.call("metadata", room=71, pages=DST, aux_index=5)
    prefill.call("open", room=71)
    assert prefill.call("wait", room=71, states=[WAITING, FAILED], timeout=30)["state"] == WAITING
    prefill.call("send", room=71, pages=SRC, aux_index=2)
    assert prefill.call("wait", room=71, states=[SUCCESS, FAILED], timeout=30)["state"] == SUCCESS
    assert decode.call("wait", room=71, states=[SUCCESS, FAILED], timeout=30)["state"] == SUCCESS
    assert decode.call("check", src_pages=SRC, dst_pages=DST, aux_src=2, aux_dst=5)["mismatch"] is None
