"""TorchP2PConnector in real vLLM: a prefill instance (kv_producer) and decode instances
(kv_consumer), each a process, configured only through kv_transfer_config.

The prefill instance has a small cache (33 blocks and the null block: one max-length request) and a short lease, so
that a request's blocks are taken by the next long prompt once its lease ends. The model's
weights are large enough that attention picks positions: blocks moved to the wrong place change
the logprobs, which the tests compare."""
from __future__ import annotations

import re
import time

import pytest
from conftest import kv_config
from tiny_model import WORDS

BLOCK = 32  # instance.py's block_size
MAX_LEN = 1024  # 32 blocks
LENGTHS = [5, 31, 32, 33, 200, 700]  # within a block, block edges, many blocks
MAX_TOKENS = 12
LEASE = 4.0
LOGPROB_TOLERANCE = 1e-3
# Three instances start in the first test's setup: minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(900)


def tokens(n: int, offset: int = 0) -> list[int]:
    """n prompt token ids of the tiny model (BOS first); `offset` makes prompts differ."""
    return [1] + [3 + (offset + 7 * i) % len(WORDS) for i in range(n - 1)]


@pytest.fixture(scope="module")
def trio(sharp_model, instances):
    """(prefill, decode, mismatched decode), started side by side. The prefill instance also
    serves the reference requests, alone. The mismatched one uses blocks of 64 tokens (the CPU
    backend takes multiples of 32) and recomputes what it fails to load."""
    prefill = instances(sharp_model, enable_prefix_caching=False, max_model_len=MAX_LEN, num_gpu_blocks_override=34,
                        **kv_config("kv_producer", 5711, kv_lease_duration=LEASE))
    decode = instances(sharp_model, env={"TORCH_P2P_LOG": "info"}, max_model_len=MAX_LEN,
                       **kv_config("kv_consumer", 5721))
    mismatched = instances(sharp_model, max_model_len=MAX_LEN, block_size=64,
                           **kv_config("kv_consumer", 5731, kv_load_failure_policy="recompute"))
    return prefill.ready(), decode.ready(), mismatched.ready()


def prefill_for_decode(prefill, prompt) -> dict:
    params = prefill.ask(prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["remote_block_ids"], params
    return params


def assert_same(out, alone, what):
    assert out["finish_reason"] == "length", (what, out)
    assert out["tokens"] == alone["tokens"], what
    diff = max(abs(a - b) for a, b in zip(out["logprobs"], alone["logprobs"]))
    assert len(out["logprobs"]) == MAX_TOKENS and diff <= LOGPROB_TOLERANCE, (what, diff)


def pulled_blocks(decode, count: int) -> list[int]:
    """The block counts of the decode instance's pulls, once it has logged `count` of them."""
    deadline = time.monotonic() + 10
    while True:
        found = [int(m.group(1)) for line in decode.log if (m := re.search(r"pulled (\d+) blocks \(\d+ bytes\)", line))]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_disaggregated_logprobs_match_one_instance(trio):
    prefill, decode, _ = trio
    params = {}
    for i, n in enumerate(LENGTHS):
        prompt = tokens(n, offset=i)
        alone = prefill.ask(prompt, MAX_TOKENS)
        params = prefill_for_decode(prefill, prompt)
        for key in ("remote_blocks_expiry_time", "transfer_mode", "pp_size", "dcp_size", "tp_size"):
            assert key in params, key  # what NixlConnector's params carry, for a router
        assert_same(decode.ask(prompt, MAX_TOKENS, params), alone, f"prompt of {n} tokens")
        # The decode side pulled the prompt's blocks (vLLM recomputes none of them) ...
        pulled = pulled_blocks(decode, i + 1)
        assert len(pulled) == i + 1 and pulled[-1] == -(-n // BLOCK) == len(params["remote_block_ids"][0]), pulled
        # ... and told the prefill side, which freed them then, not at the lease's end.
        assert prefill.grep(f"request {params['remote_request_id']}'s blocks freed: a decode engine pulled",
                            wait=5), prefill.tail()
    assert not decode.grep("TorchP2PConnector: loading request") and not prefill.grep("no decode engine pulled")
    # The prefill side's caches are in shared memory (share_cpu_cache): the decode side maps them.
    assert decode.grep("the cma route maps the shared memory of peer"), decode.tail()


def test_decode_prefix_cache_hit_pulls_only_the_tail(trio):
    prefill, decode, _ = trio
    head, whole = tokens(200, offset=50), tokens(300, offset=50)  # the first 200 tokens are the same
    decode.ask(head, MAX_TOKENS, prefill_for_decode(prefill, head))
    before = len(pulled_blocks(decode, 0))
    alone = prefill.ask(whole, MAX_TOKENS)
    assert_same(decode.ask(whole, MAX_TOKENS, prefill_for_decode(prefill, whole)), alone, "prefix hit")
    pulled = pulled_blocks(decode, before + 1)
    # The decode instance's prefix cache holds the head's 6 whole blocks: only the other 4 move.
    assert pulled[before:] == [-(-300 // BLOCK) - 200 // BLOCK], pulled


def test_load_after_the_lease_fails_or_recomputes(trio):
    """The prefill side's lease ends before the decode side loads, and a long prompt takes every
    block meanwhile: the decode request fails (kv_load_failure_policy "fail") rather than
    generating from another prompt's KV. With the expiry time in the params, the decode side
    does not even try: it computes the prompt itself."""
    prefill, decode, _ = trio
    prompt = tokens(300, offset=70)
    alone = prefill.ask(prompt, MAX_TOKENS)
    params = prefill_for_decode(prefill, prompt)
    rid = params["remote_request_id"]
    assert prefill.grep(f"no decode engine pulled request {rid}'s blocks within the lease", wait=LEASE + 30), \
        prefill.tail()
    prefill.ask(tokens(MAX_LEN - 4, offset=71), 1)  # takes 32 of the 33 blocks: the request's are overwritten
    # A router that drops the expiry time (or a decode host whose clock is behind): the pull
    # happens, and the hold check refuses what it read.
    late = {k: v for k, v in params.items() if k != "remote_blocks_expiry_time"}
    out = decode.ask(prompt, MAX_TOKENS, late)
    assert out["finish_reason"] == "error" or out["tokens"] == alone["tokens"], ("other tokens", out, alone)
    assert out["finish_reason"] == "error", (out, alone)  # the hold check failed the load
    assert decode.grep("no longer held the blocks once they were read", wait=5), decode.tail()
    out = decode.ask(prompt, MAX_TOKENS, params)
    assert decode.grep(f"is computed here: the prefill engine's lease on its blocks ended", wait=5)
    assert_same(out, alone, "computed after the expiry")


def test_incompatible_decode_is_refused_and_recomputes(trio):
    """A decode instance of another block size: the handshake names the difference, nothing is
    read, and kv_load_failure_policy "recompute" computes the prompt there."""
    prefill, _, mismatched = trio
    prompt = tokens(100, offset=80)
    alone = prefill.ask(prompt, MAX_TOKENS)
    out = mismatched.ask(prompt, MAX_TOKENS, prefill_for_decode(prefill, prompt))
    assert mismatched.grep("is incompatible with this one: block_size 64 here, 32 there", wait=5), mismatched.tail()
    assert out["finish_reason"] == "length" and out["tokens"] == alone["tokens"], (out, alone)


def test_prefill_killed_fails_decode_request_promptly(trio):
    """The whole prefill instance dies after its prefills, before the decode side loads: the
    request ends with vLLM's error (kv_load_failure_policy "fail") within a second, or, if the
    pull raced the death and the hold check passed, with the right tokens; the decode instance
    goes on serving."""
    prefill, decode, _ = trio
    prompts = [tokens(300, offset=99), tokens(200, offset=98)]
    alone = prefill.ask(prompts[0], MAX_TOKENS)
    held = [prefill_for_decode(prefill, p) for p in prompts]
    prefill.kill()
    killed = time.monotonic()
    out = decode.ask(prompts[0], MAX_TOKENS, held[0], timeout=30)
    assert time.monotonic() - killed < 1.0, f"the decode request ended {time.monotonic() - killed:.2f} s after"
    assert out["finish_reason"] == "error" or out["tokens"] == alone["tokens"], out
    sent = time.monotonic()  # kill() returned: every process of the prefill instance has exited
    out = decode.ask(prompts[1], MAX_TOKENS, held[1], timeout=30)
    elapsed = time.monotonic() - sent
    assert out["finish_reason"] == "error", out
    assert elapsed < 1.0, f"the decode request ended {elapsed:.2f} s after it was sent to a dead prefill instance"
    assert decode.grep("TorchP2PConnector: loading request", wait=1)
    again = decode.ask(tokens(40, offset=5), 3, timeout=60)
    assert again["finish_reason"] == "length"
