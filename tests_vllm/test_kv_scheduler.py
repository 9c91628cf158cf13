"""TorchP2PConnector's scheduler half, called as vLLM's scheduler calls it (no instance): what
it does with kv_transfer_params it cannot serve, with an aborted decode request, and with a
prefill request's hold (its token in the workers' hold table until vLLM frees the blocks)."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.request")

from vllm.v1.request import RequestStatus  # noqa: E402

from torch_p2p.integrations.vllm import holds  # noqa: E402
from torch_p2p.integrations.vllm.scheduler import Scheduler  # noqa: E402

PORT = 5791


class _KVConfig:
    def __init__(self, producer: bool):
        self.is_kv_producer = producer

    def get_from_extra_config(self, key, default):
        return {"side_channel_port": PORT, "kv_lease_duration": 7.0}.get(key, default)


def scheduler(producer: bool) -> Scheduler:
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, decode_context_parallel_size=1,
                               data_parallel_index=0)
    return Scheduler(SimpleNamespace(kv_transfer_config=_KVConfig(producer), parallel_config=parallel), "engine-p")


def request(rid: str, params: dict | None, n: int = 100, status=RequestStatus.WAITING) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(n)), status=status,
                           num_computed_tokens=n)


def remote(**changes) -> dict:
    params = dict(do_remote_prefill=True, remote_engine_id="engine-p", remote_request_id="p-1",
                  remote_host="127.0.0.1", remote_port=5711, remote_block_ids=[[4, 5, 6, 7]], tp_size=1,
                  torch_p2p_hold=[3, 1234], remote_blocks_expiry_time=time.time() + 30)
    params.update(changes)
    return {k: v for k, v in params.items() if v is not None}


class _Blocks:
    def get_unhashed_block_ids(self):
        return [10, 11, 12, 13]


@pytest.mark.parametrize("changes,words", [
    (dict(remote_block_ids=[[1, 2], [3, 4]]), "2 KV cache groups"),
    (dict(torch_p2p_hold=None), "torch_p2p_hold missing"),
    (dict(remote_port="x"), "bad kv_transfer_params"),
    (dict(transfer_mode="push"), "TorchP2PConnector pulls"),
    (dict(pp_size=2), "pipeline"),
    (dict(remote_blocks_expiry_time=time.time() - 5), "lease on its blocks ended"),
])
def test_params_it_cannot_serve_are_computed_here(changes, words, caplog):
    """No exception into vLLM's scheduler: a warning naming why, and no external tokens."""
    s = scheduler(producer=False)
    req = request("d-1", remote(**changes))
    log = logging.getLogger("vllm.torch_p2p")  # vLLM's loggers do not propagate to caplog's
    log.addHandler(caplog.handler)
    try:
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        log.removeHandler(caplog.handler)
    assert any(words in r.getMessage() for r in caplog.records), caplog.text
    s.update_state_after_alloc(req, _Blocks(), 0)
    assert s.build_connector_meta(None).loads == []


def test_a_load_and_an_aborted_request():
    s = scheduler(producer=False)
    req = request("d-1", remote())
    assert s.get_num_new_matched_tokens(req, 32) == (68, True)
    assert s.get_num_new_matched_tokens(req, 32) == (68, True)  # asked again: the same answer
    s.update_state_after_alloc(req, _Blocks(), 68)
    (load,) = s.build_connector_meta(None).loads
    assert (load.local_blocks, load.remote_blocks, load.hold) == ([10, 11, 12, 13], [4, 5, 6, 7], (3, 1234))
    # Aborted before its blocks were allocated: the prefill engine is still told to free its own.
    aborted = request("d-2", remote(remote_request_id="p-2"), status=RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(aborted, []) == (False, None)
    (notice,) = s.build_connector_meta(None).loads
    assert notice.remote_request_id == "p-2" and notice.local_blocks == []


def test_a_hold_lives_in_the_table_until_vllm_frees_the_blocks():
    table = holds.create(PORT, 4)
    try:
        s = scheduler(producer=True)
        done = request("p-1", {"do_remote_decode": True}, status=RequestStatus.FINISHED_LENGTH_CAPPED)
        before = time.time()
        hold, params = s.request_finished(done, [4, 5])
        assert hold and params["remote_block_ids"] == [[4, 5]] and params["transfer_mode"] == "pull"
        assert params["pp_size"] == params["dcp_size"] == params["tp_size"] == 1
        assert before + 7.0 <= params["remote_blocks_expiry_time"] <= time.time() + 7.0
        slot, token = params["torch_p2p_hold"]
        assert int(table[slot]) == token != 0 and s.build_connector_meta(None).leases == {"p-1": 7.0}
        # vLLM reports the blocks done (pulled, or the lease ended), then frees them: the hold ends first.
        s.update_connector_output(SimpleNamespace(finished_sending={"p-1"}))
        assert int(table[slot]) == 0
        # The slot serves the next hold, with a new token; aborted requests hold nothing.
        _, again = s.request_finished(request("p-2", {"do_remote_decode": True},
                                              status=RequestStatus.FINISHED_STOPPED), [6])
        assert again["torch_p2p_hold"][1] != token
        aborted = request("p-3", {"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)
        assert s.request_finished(aborted, [7]) == (False, None)
        # Every slot taken: the request offers no remote decode (the decode side computes it).
        for i in range(3):
            s.request_finished(request(f"p-{4 + i}", {"do_remote_decode": True},
                                       status=RequestStatus.FINISHED_STOPPED), [8 + i])
        assert s.request_finished(request("p-9", {"do_remote_decode": True},
                                          status=RequestStatus.FINISHED_STOPPED), [12]) == (False, None)
    finally:
        holds.remove(PORT)
