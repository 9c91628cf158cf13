"""Connectors that time their loads, for benchmarks/vllm_disagg.py: the same clock for
TorchP2PConnector and NixlConnector, in the decode worker, from the step that starts a
request's load to the step that reports it finished (a line "LOAD <request> <seconds>
<failed>" on stdout). TimedFloorConnector moves nothing: what vLLM's own steps cost a load, the
floor under every connector's."""
from __future__ import annotations

import time

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from torch_p2p.integrations.vllm.connector import TorchP2PConnector


class _Timed:
    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        ids = list(meta.reqs_to_recv) if hasattr(meta, "reqs_to_recv") else [l.request_id for l in meta.loads]
        starts = self.__dict__.setdefault("_load_starts", {})
        for rid in ids:
            starts.setdefault(rid, time.perf_counter())
        return super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        starts = self.__dict__.setdefault("_load_starts", {})
        for rid in results.finished_recving:
            if rid in starts:
                print(f"LOAD {rid} {time.perf_counter() - starts.pop(rid):.6f} {rid in results.failed_recving}",
                      flush=True)
        return results


class TimedTorchP2PConnector(_Timed, TorchP2PConnector):
    pass


class TimedNixlConnector(_Timed, NixlConnector):
    pass


class TimedFloorConnector(TimedTorchP2PConnector):
    """TorchP2PConnector whose decode side moves no byte: each load is reported done by the
    step that starts it, so its time is vLLM's own, from start_load_kv to get_transfer_results
    (the request then decodes from whatever its blocks held)."""

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        loads, meta.loads = meta.loads, []
        starts = self.__dict__.setdefault("_load_starts", {})
        for load in loads:
            starts.setdefault(load.request_id, time.perf_counter())
        self.__dict__.setdefault("_floor_done", set()).update(load.request_id for load in loads)
        return TorchP2PConnector.start_load_kv(self, forward_context, **kwargs)  # the prefill side's holds

    def get_transfer_results(self, finished_req_ids):
        results = TorchP2PConnector.get_transfer_results(self, finished_req_ids)
        done, self._floor_done = self.__dict__.get("_floor_done", set()), set()
        results.finished_recving = set(results.finished_recving or ()) | done
        for rid in done:
            print(f"LOAD {rid} {time.perf_counter() - self._load_starts.pop(rid):.6f} False", flush=True)
        return results
