"""TorchP2PConnector in real vLLM: a prefill instance (kv_producer) and a decode instance
(kv_consumer), two processes, configured only through kv_transfer_config."""
from __future__ import annotations

import re
import time

import pytest
from conftest import kv_config
from tiny_model import WORDS

BLOCK = 32  # instance.py's block_size
LENGTHS = [5, 31, 32, 33, 200, 700]  # within a block, block edges, many blocks
MAX_TOKENS = 12


def tokens(n: int, offset: int = 0) -> list[int]:
    """n prompt token ids of the tiny model (BOS first); `offset` makes prompts differ."""
    return [1] + [3 + (offset + 7 * i) % len(WORDS) for i in range(n - 1)]


@pytest.fixture(scope="module")
def pair(tiny_model, instances):
    """(prefill, decode). The prefill instance also serves the reference requests, alone."""
    prefill = instances(tiny_model, enable_prefix_caching=False, **kv_config("kv_producer", 5711))
    decode = instances(tiny_model, env={"TORCH_P2P_LOG": "info"}, **kv_config("kv_consumer", 5721))
    return prefill.ready(), decode.ready()


def disaggregated(prefill, decode, prompt):
    first = prefill.ask(prompt, 1, {"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["remote_block_ids"], params
    return params, decode.ask(prompt, MAX_TOKENS, params)


def test_disaggregated_tokens_match_one_instance(pair):
    prefill, decode = pair
    for i, n in enumerate(LENGTHS):
        prompt = tokens(n, offset=i)
        alone = prefill.ask(prompt, MAX_TOKENS)
        params, out = disaggregated(prefill, decode, prompt)
        assert out["finish_reason"] == "length"
        assert out["tokens"] == alone["tokens"], f"prompt of {n} tokens"
        # The decode side pulled the prompt's blocks (vLLM recomputes none of them: the
        # scheduler loaded all of them from us) ...
        rid = re.escape(params["remote_request_id"])
        pulled = [line for line in decode.grep("TorchP2PConnector: pulled", wait=5)
                  if re.search(r"pulled (\d+) blocks \((\d+) bytes\) of request \S+ in", line)]
        assert len(pulled) == i + 1, decode.tail()
        blocks = int(re.search(r"pulled (\d+) blocks", pulled[-1]).group(1))
        assert blocks == -(-n // BLOCK) == len(params["remote_block_ids"][0])
        # ... and told the prefill side, which freed them then, not at the lease's end.
        assert prefill.grep(f"request {params['remote_request_id']}'s blocks freed: a decode engine pulled",
                            wait=5), prefill.tail()
    assert not decode.grep("TorchP2PConnector: loading request") and not prefill.grep("no decode engine pulled")
    # The prefill side's caches are in shared memory (share_cpu_cache): the decode side maps them.
    assert decode.grep("the cma route maps the shared memory of peer"), decode.tail()


def test_prefill_killed_fails_decode_request_promptly(pair):
    """The whole prefill instance dies after its prefills, before the decode side loads. A pull
    that races the death may still read the finished blocks (the prefill caches are shared
    memory, which outlives the process until the decode engine sees it exit): then the tokens
    are right. Once the death is seen, a request ends with vLLM's error (kv_load_failure_policy
    "fail") within a second, and the decode instance goes on serving."""
    prefill, decode = pair
    prompts = [tokens(300, offset=99), tokens(200, offset=98)]
    alone = prefill.ask(prompts[0], MAX_TOKENS)
    held = [prefill.ask(p, 1, {"do_remote_decode": True})["kv_transfer_params"] for p in prompts]
    prefill.kill()
    killed = time.monotonic()
    out = decode.ask(prompts[0], MAX_TOKENS, held[0], timeout=30)
    assert time.monotonic() - killed < 1.0, f"the decode request ended {time.monotonic() - killed:.2f} s after"
    assert out["finish_reason"] == "error" or out["tokens"] == alone["tokens"], out
    time.sleep(2.0)  # every process of the prefill instance has exited by now
    sent = time.monotonic()
    out = decode.ask(prompts[1], MAX_TOKENS, held[1], timeout=30)
    elapsed = time.monotonic() - sent
    assert out["finish_reason"] == "error", out
    assert elapsed < 1.0, f"the decode request ended {elapsed:.2f} s after it was sent to a dead prefill instance"
    assert decode.grep("TorchP2PConnector: loading request", wait=1)
    again = decode.ask(tokens(40, offset=5), 3, timeout=60)
    assert again["finish_reason"] == "length"
