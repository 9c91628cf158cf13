"""The ``torch_p2p`` transfer backend of SGLang's PD disaggregation: manager, sender, receiver
and bootstrap server over SGLang's ``Common*`` classes (bootstrap over HTTP, control messages
over ZMQ, the KVPoll bookkeeping, heartbeats and timeouts), with torch_p2p.kv moving the pages.

The flow, as SGLang's scheduler drives it: a decode rank registers its pool once per prefill
rank (a KVCacheHandle of its KV pages and aux rows, and the facts both sides must share); for
each request it sends the room's page indices and aux row; the prefill rank's sender is then
WaitingForInput, and each ``send`` of a chunk becomes one push of its pages (``KVCache.push``,
one engine call; the last chunk adds the aux row). The prefill rank reports Success to decode
only after every push of the room completed and the room was still its own (not aborted): the
prefill scheduler frees the source pages only after abort or Success, and abort marks the room
Failed before that, so a push that read pages freed under it always ends Failed. A room aborted
while its push is in flight is reported Failed only once the push has ended, so that decode
never frees (and reuses) pages that are still being written. A decode registration that does
not match (dtype, page size, layers, head bytes, MLA) fails every room of that decode rank with
a message naming the difference; a room from a decode rank this prefill instance never heard
register (it restarted) fails too. Dead or frozen prefill instances are SGLang's heartbeat and
waiting timeout: the room turns Failed within them.

Thread model: SGLang's scheduler thread calls the sender/receiver methods; one control thread
per manager reads its ZMQ socket; one transfer thread per prefill manager issues pushes and
waits for them (futures complete on the engine's dispatcher thread, which only sets them).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (ABORT_TAG, AbortNotification, CommonKVBootstrapServer,
                                                   CommonKVManager, CommonKVReceiver, CommonKVSender)
from sglang.srt.disaggregation.utils import DisaggregationMode

from ... import Engine, kv
from ..vllm.transfer import compat_differences
from . import pools

_log = logging.getLogger("sglang.torch_p2p")
_REGISTER, _STATUS = b"P2P_REGISTER", b"P2P_STATUS"


@dataclass
class _Destination:
    """One decode rank's part of a room (what ``_room_notify_targets`` reads)."""
    endpoint: str
    dst_port: int
    session: str
    kv_indices: np.ndarray
    aux_index: int | None
    is_dummy: bool


@dataclass
class _Chunk:
    room: int
    kv_indices: np.ndarray
    index_slice: slice
    last: bool
    aux_index: int | None


class TorchP2PKVManager(CommonKVManager):
    kv_status_msg_tag = _STATUS
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    timeout = 60.0  # seconds a push may take before its room fails

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if any(args.state_types):
            raise ValueError(f"torch_p2p's SGLang backend moves KV pages and aux rows, not the state pools "
                             f"{[str(t) for t in args.state_types]} (hybrid models): use mooncake or nixl")
        device = str(getattr(server_args, "device", None) or "cuda")
        self.engine = Engine(f"cuda:{args.gpu_id}" if device == "cuda" else device)
        self.shape = pools.pool_shape(args, bool(is_mla_backend), self.attn_tp_rank)
        self.cache = pools.kv_cache(self.engine, args, self.shape)
        self.aux = pools.aux_caches(self.engine, args)
        self.session = f"{self.local_ip}:{self.rank_port}"
        self._stopped = False
        self._peers: dict[str, tuple[kv.KVCacheHandle, list[kv.KVCacheHandle]]] = {}
        self._refused: dict[str, str] = {}  # decode session -> why its rooms fail
        self._in_flight: set[int] = set()  # rooms with a push issued and not ended
        self._expected: dict[int, int] = {}  # room -> decode ranks it waits for (their metadata says)
        self._lock = threading.Lock()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._chunks: queue.Queue[_Chunk] = queue.Queue()
            self._start(self._control_prefill, self._transfer)
        else:
            self._start(self._control_decode)
            self._start_heartbeat_checker_thread()

    def _start(self, *loops) -> None:
        for loop in loops:
            threading.Thread(target=loop, name=f"torch_p2p-{loop.__name__.strip('_')}", daemon=True).start()

    # -- decode side --------------------------------------------------------------------------
    def build_receiver_registration_message(self) -> list[bytes]:
        facts = dict(self.shape.compat(), heads=self.shape.heads, first_head=self.shape.first_head)
        return [_REGISTER, self.local_ip.encode(), str(self.rank_port).encode(), self.session.encode(),
                self.cache.handle.to_bytes(), json.dumps([a.handle.to_bytes().decode("latin-1") for a in self.aux]).encode(),
                json.dumps(facts).encode()]

    def build_receiver_metadata_message(self, *, bootstrap_room, required_dst_info_num, kv_indices, aux_index,
                                        state_indices, decode_prefix_len, is_dummy, device_kv_indices=None):
        return [str(bootstrap_room).encode(), self.local_ip.encode(), str(self.rank_port).encode(),
                self.session.encode(), b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes(),
                str(aux_index).encode(), str(required_dst_info_num).encode(), str(int(is_dummy)).encode()]

    def _control_decode(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if msg is None or self.handle_abort_ack_message(msg):
                continue
            parsed = self.parse_kv_status_message(msg)
            if parsed is not None:
                room, status, prefill_rank, reason = parsed
                self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prefill_rank,
                                          failure_reason=reason or None)

    # -- prefill side -------------------------------------------------------------------------
    def _control_prefill(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if not msg:
                continue
            try:
                if msg[0] == _REGISTER:
                    self._register_peer(msg)
                elif msg[0] == ABORT_TAG:
                    self._abort_from_decode(msg)
                else:
                    self._add_destination(msg)
            except Exception as e:  # noqa: BLE001 - one bad message must not stop the control thread
                _log.error("torch_p2p: dropping a control message (%s: %s)", type(e).__name__, e)

    def _register_peer(self, msg: list[bytes]) -> None:
        session = msg[3].decode()
        facts = json.loads(msg[6])
        mine = dict(self.shape.compat())
        theirs = {k: facts.get(k) for k in mine}
        differences = compat_differences(mine, theirs)
        handle = kv.KVCacheHandle.from_bytes(msg[4])
        aux = [kv.KVCacheHandle.from_bytes(h.encode("latin-1")) for h in json.loads(msg[5])]
        if not differences and len(aux) != len(self.aux):
            differences = [f"aux buffer groups {len(self.aux)} here, {len(aux)} there"]
        with self._lock:
            if differences:
                self._refused[session] = ("torch_p2p: the decode rank at " + session + " does not match this prefill "
                                          "rank: " + "; ".join(differences))
                _log.error(self._refused[session])
            else:
                self._refused.pop(session, None)
                self._peers[session] = (handle, aux)

    def _add_destination(self, msg: list[bytes]) -> None:
        room, session = int(msg[0]), msg[3].decode()
        dest = _Destination(endpoint=msg[1].decode(), dst_port=int(msg[2]), session=session,
                            kv_indices=np.frombuffer(msg[4], dtype=np.int32),
                            aux_index=None if msg[5] == b"None" else int(msg[5]), is_dummy=msg[7] == b"1")
        infos = self.transfer_infos.setdefault(room, {})
        infos[session] = dest
        with self._lock:
            why = self._refused.get(session) or (None if session in self._peers or dest.is_dummy else
                                                 f"torch_p2p: decode rank {session} never registered with this "
                                                 "prefill instance (it restarted): the request must be retried")
        if why:
            self.record_failure(room, why)
            self.update_status(room, KVPoll.Failed)
            self.send_kv_status_message(targets=[(dest.endpoint, dest.dst_port)], bootstrap_room=room,
                                        status=KVPoll.Failed, failure_reason=why)
        else:
            with self._lock:
                self._expected[room] = int(msg[6])
            self.room_ready(room)

    def room_ready(self, room: int) -> None:
        """WaitingForInput once every decode rank of the room sent its pages; called when
        metadata arrives and when the sender opens the room, whichever comes last (decode's
        metadata may arrive before prefill's scheduler creates the sender, and a status for a
        room not opened yet is dropped)."""
        with self._lock:
            ready = len(self.transfer_infos.get(room, {})) == self._expected.get(room, -1)
        if ready:
            self.req_to_decode_prefix_len.setdefault(room, 0)
            self.update_status(room, KVPoll.WaitingForInput)

    def _abort_from_decode(self, msg: list[bytes]) -> None:
        note = AbortNotification.from_zmq(msg)
        if note is not None and self.request_status.get(note.room) not in (None, KVPoll.Success):
            self.record_failure(note.room, "Aborted by the decode side")
            self.update_status(note.room, KVPoll.Failed)

    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index=None,
                             state_indices=None, num_kv_tokens=None, **_):
        if self.request_status.get(bootstrap_room) in (None, KVPoll.Failed):
            return
        with self._lock:
            self._in_flight.add(bootstrap_room)
        self._chunks.put(_Chunk(bootstrap_room, np.asarray(kv_indices), index_slice, is_last_chunk, aux_index))

    def _transfer(self) -> None:
        while not self._stopped:
            chunk = self._chunks.get()
            try:
                error = self._push(chunk)
            except Exception as e:  # noqa: BLE001 - reported as the room's failure
                error = f"{type(e).__name__}: {e}"
            self._conclude(chunk, error)

    def _push(self, chunk: _Chunk) -> str | None:
        """Pushes one chunk to every decode rank of its room and waits for the pushes; the
        reason it failed, or None."""
        if self.request_status.get(chunk.room) in (None, KVPoll.Failed):
            return None  # aborted before we started: nothing was read
        self.update_status(chunk.room, KVPoll.Transferring)
        futures = []
        for dest in list(self.transfer_infos.get(chunk.room, {}).values()):
            if dest.is_dummy:
                continue
            with self._lock:
                handle, aux = self._peers[dest.session]
            dst = dest.kv_indices[chunk.index_slice]
            if len(dst) != len(chunk.kv_indices):
                return (f"torch_p2p: room {chunk.room}: {len(chunk.kv_indices)} pages to send, decode rank "
                        f"{dest.session} gave {len(dst)} for them")
            if len(dst):
                futures.append(self.cache.push(handle, chunk.kv_indices, dst, timeout=self.timeout))
            if chunk.last and chunk.aux_index is not None and dest.aux_index is not None:
                futures += [mine.push(theirs, [chunk.aux_index], [dest.aux_index], timeout=self.timeout)
                            for mine, theirs in zip(self.aux, aux)]
        for f in futures:
            try:
                f.wait()
            except Exception as e:  # noqa: BLE001 - every push must end before the room is concluded
                error = f"torch_p2p: a push of room {chunk.room} failed ({type(e).__name__}: {e})"
                for rest in futures:
                    _settle(rest)
                return error
        return None

    def _conclude(self, chunk: _Chunk, error: str | None) -> None:
        room = chunk.room
        with self._lock:
            if chunk.last or error is not None:
                self._in_flight.discard(room)
            # Decided under the lock that abort() takes: a room aborted from here on is
            # reported by abort() itself, as no push is in flight any more.
            aborted = self.request_status.get(room) in (None, KVPoll.Failed)
        if error is not None:
            self.record_failure(room, error)
            self.update_status(room, KVPoll.Failed)
        if error is not None or aborted:
            self.send_kv_status_message(targets=self._room_notify_targets(room), bootstrap_room=room,
                                        status=KVPoll.Failed, failure_reason=error or "Aborted by the prefill side")
        elif chunk.last:
            self.update_status(room, KVPoll.Success)
            self.send_kv_status_message(targets=self._room_notify_targets(room), bootstrap_room=room,
                                        status=KVPoll.Success)

    def abort_room(self, room: int) -> None:
        """The prefill side's abort: decode hears Failed now, or when the room's push ends."""
        with self._lock:
            if room in self._in_flight:
                return
        self.send_kv_status_message(targets=self._room_notify_targets(room), bootstrap_room=room,
                                    status=KVPoll.Failed, failure_reason="Aborted by the prefill side")

    def close(self) -> None:
        self._stopped = True
        self.cache.close()
        for a in self.aux:
            a.close()
        self.engine.close()


def _settle(future) -> None:
    try:
        future.wait()
    except Exception:  # noqa: BLE001 - the first failure is the one reported
        pass


class TorchP2PKVSender(CommonKVSender):
    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        if self.conclude_state is None:
            mgr.room_ready(bootstrap_room)

    def clear(self) -> None:
        super().clear()
        with self.kv_mgr._lock:
            self.kv_mgr._expected.pop(self.bootstrap_room, None)

    def abort(self):
        super().abort()
        self.kv_mgr.abort_room(self.bootstrap_room)


class TorchP2PKVReceiver(CommonKVReceiver):
    pass


class TorchP2PKVBootstrapServer(CommonKVBootstrapServer):
    pass
