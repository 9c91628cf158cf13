"""Paged KV caches moved between engines, as disaggregated serving moves a request's cache from
a prefill engine to a decode engine: the prefill side pushes blocks into the decode side's
cache, or the decode side pulls them (as vLLM's NIXL connector does).

    cache = kv.KVCache(engine, layers, "flash_attn")        # every storage registered once
    blob = cache.handle.to_bytes()                          # to each peer, once per pair
    peer = kv.KVCacheHandle.from_bytes(blob)
    fut = cache.push(peer, my_blocks, their_blocks, notify=tag)   # one engine call
    their_cache.notification(tag).wait()                    # on the peer: the blocks are there

A layout names the axes of one layer's tensor (``LAYOUTS``, or a string of the same words):
"kv" (K and V, size 2), "blocks", "tokens" (a block's tokens), "heads" (KV heads), "dim" (head
dim or latent), and optionally "layers" for one stacked tensor. Without "blocks" the tokens axis
is token-granular (SGLang's pool) and ``block_size`` cuts it into blocks. Without "kv" a layer
is a (K, V) pair of tensors, or one latent tensor (MLA). The two sides may use different
layouts and different ranges of the model's KV heads (tensor parallelism of different degrees):
the views permute axes and slice the heads axis to what both hold; nothing is copied.

Each push or pull is one ``write_slices`` / ``read_slices`` call, one ``p2p.pages`` entry per
layer and store: one striping decision, one completion. Consecutive block ids merge into one
run inside the engine wherever a block is one run of bytes on both sides, which is why vLLM's
FlashAttention layout is paged as one axis of 2 x num_blocks pages (K of block b is page b,
its V page num_blocks + b).

Thread model: a KVCache may be used from any thread; its futures complete on the engine's
dispatcher thread (callbacks must not block).
"""
from ._cache import KVCache, KVCacheHandle, PushStream
from ._layout import LAYOUTS

__all__ = ["KVCache", "KVCacheHandle", "PushStream", "LAYOUTS"]
