"""A prefill instance that freezes (SIGSTOP) while a decode instance loads from it, and comes
back: the decode side gives up after its transfer_timeout, computes the prompt itself
(kv_load_failure_policy "recompute"), gives the blocks to other requests, and nothing the
frozen instance still had to send lands in them once it resumes.

The decode side reads over the fabric (cma off): the cma route copies a stopped process's
memory without it, so the pull would not wait on the frozen instance. Both caches are small
(33 blocks and the null block) so that the blocks of the failed load are taken by the next
long prompt."""
from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import kv_config
from test_kv_connector import MAX_LEN, MAX_TOKENS, assert_same, prefill_for_decode, pulled_blocks, tokens

TRANSFER_TIMEOUT = 10.0  # the connector's default: a pull from a silent prefill fails after it
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def pair(sharp_model, instances):
    env = {"TORCH_P2P_CMA": "0", "TORCH_P2P_LOG": "info"}
    prefill = instances(sharp_model, env=env, enable_prefix_caching=False, max_model_len=MAX_LEN,
                        num_gpu_blocks_override=34, **kv_config("kv_producer", 5811))
    decode = instances(sharp_model, env=env, max_model_len=MAX_LEN, num_gpu_blocks_override=34,
                       **kv_config("kv_consumer", 5821, kv_load_failure_policy="recompute"))
    return prefill.ready(), decode.ready()


def test_prefill_stopped_during_a_load_recomputes_and_nothing_lands_after_it_resumes(pair):
    prefill, decode = pair
    warm, victim, other, after = tokens(200, 1), tokens(300, 2), tokens(900, 3), tokens(100, 4)
    alone = {id(p): prefill.ask(p, MAX_TOKENS) for p in (warm, victim, other, after)}
    # The decode side knows the prefill instance (handshake done) before it freezes.
    assert_same(decode.ask(warm, MAX_TOKENS, prefill_for_decode(prefill, warm)), alone[id(warm)], "warm-up")
    assert len(pulled_blocks(decode, 1)) == 1
    assert not decode.grep("the cma route maps the shared memory")  # the fabric carries the pulls
    params = prefill_for_decode(prefill, victim)
    failures = len(decode.grep("TorchP2PConnector: loading request"))
    os.killpg(prefill.proc.pid, signal.SIGSTOP)  # every process of the instance
    try:
        stopped = time.monotonic()
        out = decode.ask(victim, MAX_TOKENS, params, timeout=TRANSFER_TIMEOUT + 60)
        took = time.monotonic() - stopped
        assert len(decode.grep("TorchP2PConnector: loading request")) == failures + 1, decode.tail()
        assert_same(out, alone[id(victim)], "recomputed after the load failed")
        assert TRANSFER_TIMEOUT - 1 < took < TRANSFER_TIMEOUT + 30, took
        assert len(pulled_blocks(decode, 1)) == 1  # the failed load pulled nothing
        # A long prompt takes 29 of the 33 blocks: most of the failed load's among them.
        assert_same(decode.ask(other, MAX_TOKENS), alone[id(other)], "a prompt on the failed load's blocks")
    finally:
        os.killpg(prefill.proc.pid, signal.SIGCONT)
    # The prefill instance runs again (it answers), and serves the decode side again.
    assert_same(decode.ask(after, MAX_TOKENS, prefill_for_decode(prefill, after)), alone[id(after)],
                "a load after the prefill instance resumed")
    assert len(pulled_blocks(decode, 2)) == 2
    # The long prompt again, from the decode side's prefix cache: its blocks kept their bytes.
    assert_same(decode.ask(other, MAX_TOKENS), alone[id(other)], "the long prompt's cached blocks")
