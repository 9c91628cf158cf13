"""CUDA VMM memory (PyTorch's expandable segments) on the same-host IPC route
(csrc/routes/cuda_ipc, csrc/cuda/vmm.h): the handle's export as the route reads it (CPU), and on
a GPU two processes, both with expandable_segments:True, moving a KV cache and a state dict that
span several mappings, a closed region, a killed peer."""
import os
import signal
import time

import pytest
import torch

import helpers
import peer_helpers as ph
import torch_p2p as p2p
import torch_p2p.kv as kv
import torch_p2p.weights as pw
from torch_p2p import _C
from conftest import PEER_GPU, engine_kwargs
from peer import Peer

cuda = pytest.mark.cuda
VMM = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


# -- The export in a handle (no GPU needed) ---------------------------------------------------

def test_route_bytes_travel_with_the_handle():
    """What a route adds to a handle comes back as it went; the core reads none of it."""
    with p2p.Engine("cpu", **engine_kwargs("tcp")) as e:
        remote = e.register(torch.zeros(8)).remote
        assert _C._decode_remote(remote.to_bytes())["region"]["route_bytes"] == {}  # a host region
        forged = ph.tampered(remote, route_bytes={0: b"x", 5: b"yz"})
        assert _C._decode_remote(forged.to_bytes())["region"]["route_bytes"] == {0: b"x", 5: b"yz"}
        with pytest.raises(ValueError, match="bad route id"):
            ph.tampered(remote, route_bytes={9: b"x"}).to_bytes()


def ipc_export(kind: int, handle: bytes, offset: int = 0, ptr: int = 0) -> bytes:
    """The IPC route's bytes, as routes/cuda_ipc/export.cpp writes them."""
    body = bytes([kind]) + len(handle).to_bytes(4, "little") + handle
    return body + offset.to_bytes(8, "little") + ptr.to_bytes(8, "little")


def test_ipc_exports_are_checked_as_the_route_reads_them():
    assert _C._decode_ipc_export(ipc_export(2, b"", 4096, 1 << 40), 1) == {"kind": "vmm", "offset": 4096,
                                                                           "ptr": 1 << 40}
    assert _C._decode_ipc_export(ipc_export(1, b"h" * 64), 1)["kind"] == "legacy"
    bad = [ipc_export(1, b"h" * 64), ipc_export(1, b"h" * 63), ipc_export(2, b"h" * 64), ipc_export(3, b""),
           ipc_export(2, b"")[:-1]]
    for i, b in enumerate(bad):
        with pytest.raises(ValueError, match="IPC export"):
            _C._decode_ipc_export(b, 0 if i == 0 else 1)  # a host region exports nothing


# -- Two processes on one GPU, both with expandable segments ----------------------------------

LAYERS, BLOCKS, BLOCK = 4, 256, (16, 8, 128)  # flash_attn [2, blocks, tokens, heads, dim], bf16: 32 KiB per K/V page
STATE = {"embed": (4096, 1024), "layers.0.w": (8192, 2048), "layers.0.b": (2048,), "head": (1024, 4096)}


def grow_then(shape, dtype, device: str) -> torch.Tensor:
    """A CUDA tensor allocated after the expandable segment grew and shrank its use several
    times: it lands across several of the segment's mappings."""
    for n in (24, 48, 72):
        junk = torch.empty(n << 20, dtype=torch.uint8, device=device)
        del junk
    return torch.empty(shape, dtype=dtype, device=device)


def mappings(t: torch.Tensor) -> int:
    n, why = _C._vmm_layout(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.device.index)
    assert n > 0, why
    return n


def side_start(state, fill_seed: int | None, device: str) -> dict:
    """An engine, a KV cache and a state dict in VMM memory; random (seeded) where fill_seed is
    given, poisoned otherwise. Returns the handles, the address and the mapping counts."""
    assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    engine = p2p.Engine(device, **engine_kwargs("tcp", peer_timeout=2.0))
    state["engine"] = engine
    layers = []
    for i in range(LAYERS):
        t = grow_then((2, BLOCKS, *BLOCK), torch.bfloat16, device)
        t.copy_(helpers.random_tensor(t.shape, torch.bfloat16, 10 + i) if fill_seed is not None
                else helpers.poisoned(t.shape, torch.bfloat16))
        layers.append(t)
    weights = {}
    for i, (name, shape) in enumerate(STATE.items()):
        t = grow_then(shape, torch.float32, device)
        t.copy_(helpers.random_tensor(shape, torch.float32, 100 + i) if fill_seed is not None
                else torch.zeros(shape))
        weights[name] = t
    torch.cuda.synchronize()
    state["layers"], state["weights"] = layers, weights
    state["cache"] = kv.KVCache(engine, layers, "flash_attn")
    return {"address": engine.address, "cache": state["cache"].handle.to_bytes(),
            "mappings": [mappings(t) for t in layers] + [mappings(t) for t in weights.values()]}


def push_blocks(state, peer_cache: bytes, src: list, dst: list) -> str:
    peer = kv.KVCacheHandle.from_bytes(peer_cache)
    route = state["engine"].route(peer._bases[0])
    p2p.wait(state["cache"].push(peer, src, dst), 60)
    return route


def fetch_layers(state) -> list:
    return [t.cpu() for t in state["layers"]]


def fetch_weights(state) -> dict:
    return {n: t.cpu() for n, t in state["weights"].items()}


def source_start(state) -> bytes:
    state["source"] = pw.WeightSource(state["engine"], pw.whole(state["weights"]), chunk_bytes=8 << 20)
    return state["source"].address


def source_push(state) -> int:
    return len(p2p.wait(state["source"].push(), 60).received)


def dest_start(state, leader: bytes) -> int:
    state["dest"] = pw.WeightDestination(state["engine"], pw.whole(state["weights"]), leader)
    return len(p2p.wait(state["dest"].join(), 30).chunks)


def dest_wait(state, version: int) -> None:
    p2p.wait(state["dest"].wait_for(version), 60)


def close_all(state) -> None:
    for key in ("dest", "source", "cache"):
        if key in state:
            state.pop(key).close()


@cuda
@pytest.mark.timeout(240)
def test_vmm_kv_cache_and_state_dict_move_over_ipc():
    """A KV cache pushed block by block and a state dict pushed by WeightSource, all of it in
    expandable segments across several mappings, take the IPC route and land bit for bit."""
    with Peer(env=VMM) as a, Peer(env=VMM) as b:
        mine, theirs = a.call(side_start, 1, "cuda:0"), b.call(side_start, None, PEER_GPU)
        assert max(mine["mappings"]) > 1 and max(theirs["mappings"]) > 1, (mine["mappings"], theirs["mappings"])
        g = torch.Generator().manual_seed(3)
        src, dst = torch.randperm(BLOCKS, generator=g)[:96].tolist(), torch.randperm(BLOCKS, generator=g)[:96].tolist()
        assert a.call(push_blocks, theirs["cache"], src, dst) == "ipc"
        sent, got = a.call(fetch_layers), b.call(fetch_layers)
        for s, d in zip(sent, got):
            want = helpers.poisoned(s.shape, torch.bfloat16)
            want[:, dst] = s[:, src]
            helpers.assert_same_bits(d, want)

        leader = a.call(source_start)
        assert b.call(dest_start, leader) > 0
        assert a.call(source_push) == 1
        b.call(dest_wait, 1)
        sent, got = a.call(fetch_weights), b.call(fetch_weights)
        for name in STATE:
            helpers.assert_same_bits(got[name], sent[name])
        a.call(close_all)
        b.call(close_all)


def vmm_target(state, nbytes: int) -> bytes:
    state["engine"] = p2p.Engine(PEER_GPU, **engine_kwargs("tcp", peer_timeout=2.0))
    t = grow_then((nbytes,), torch.uint8, PEER_GPU)
    t.fill_(helpers.POISON)
    state["t"], state["region"] = t, state["engine"].register(t)
    assert mappings(t) > 1
    return state["region"].remote.to_bytes()


def vmm_source(state, peer: bytes, nbytes: int, seed: int) -> str:
    state["engine"] = p2p.Engine("cuda:0", **engine_kwargs("tcp", peer_timeout=2.0))
    src = grow_then((nbytes,), torch.uint8, "cuda:0")
    src.copy_(helpers.random_tensor((nbytes,), torch.uint8, seed))
    state["src"] = src
    state["engine"].register(src)
    remote = p2p.RemoteTensor.from_bytes(peer)
    route = state["engine"].route(remote)
    p2p.wait(state["engine"].write_slices(src, remote), 60)
    return route


def write_again(state, peer: bytes) -> str:
    """The same write through the same (now stale) handle: the error it ends with."""
    try:
        p2p.wait(state["engine"].write_slices(state["src"], p2p.RemoteTensor.from_bytes(peer)), 30)
    except p2p.P2PError as e:
        return f"{type(e).__name__}: {e}"
    return "written"


def close_and_reuse(state) -> bool:
    """Closes the region and frees its tensor; a new tensor of the same size gets the same
    VMM memory (the segment keeps it mapped). Returns whether it did."""
    ptr = state["t"].data_ptr()
    state.pop("region").close()
    n = state.pop("t").numel()
    state["reused"] = torch.full((n,), 0x3C, dtype=torch.uint8, device=PEER_GPU)
    torch.cuda.synchronize()
    return state["reused"].data_ptr() == ptr


def reused_untouched(state) -> bool:
    torch.cuda.synchronize()
    return bool((state["reused"] == 0x3C).all())


def target_bytes(state) -> torch.Tensor:
    return state["t"].cpu()


@cuda
@pytest.mark.timeout(120)
def test_vmm_region_closed_and_reused_is_never_written():
    """The owner's close waits for our release (we unmap the allocations we imported); a write
    through the stale handle then fails, and the memory the allocator hands out again keeps
    its bytes."""
    nbytes = 96 << 20
    with Peer(env=VMM) as a, Peer(env=VMM) as b:
        handle = b.call(vmm_target, nbytes)
        assert a.call(vmm_source, handle, nbytes, 5) == "ipc"
        helpers.assert_same_bits(b.call(target_bytes), helpers.random_tensor((nbytes,), torch.uint8, 5))
        assert b.call(close_and_reuse)
        outcome = a.call(write_again, handle)
        assert outcome.startswith("ClosedError") and "deregistered" in outcome, outcome
        assert b.call(reused_untouched)


def stream_writes(state, peer: bytes, count: int) -> None:
    remote = p2p.RemoteTensor.from_bytes(peer)
    state["futures"] = [state["engine"].write_slices(state["src"], remote) for _ in range(count)]


def after_kill(state, peer: bytes) -> dict:
    """Waits for the writes queued before the kill, then writes again until one fails: how they
    ended, and how long after the first wait the failure came. (A write may still land in the
    dead peer's memory, which this process keeps mapped, until the peer's death is known.)"""
    ended = {"ok": 0, "PeerError": 0, "other": [], "after": None}
    start = time.monotonic()
    for f in state.pop("futures"):
        try:
            p2p.wait(f, 15)
            ended["ok"] += 1
        except p2p.PeerError:
            ended["PeerError"] += 1
        except Exception as e:  # noqa: BLE001 - reported to the test
            ended["other"].append(repr(e))
    remote = p2p.RemoteTensor.from_bytes(peer)
    while ended["after"] is None and time.monotonic() - start < 15:
        try:
            p2p.wait(state["engine"].write_slices(state["src"], remote), 15)
        except p2p.PeerError:
            ended["after"] = "PeerError"
    ended["after_s"] = time.monotonic() - start
    return ended


@cuda
@pytest.mark.timeout(120)
def test_vmm_peer_killed_mid_transfer():
    """Writes stream into a VMM region of a peer that is killed: each lands or fails with
    PeerError within the bound, and the engine goes on with another peer."""
    nbytes = 64 << 20
    with Peer(env=VMM) as a, Peer(env=VMM) as b, Peer(env=VMM) as c:
        handle = b.call(vmm_target, nbytes)
        assert a.call(vmm_source, handle, nbytes, 7) == "ipc"
        a.call(stream_writes, handle, 20)
        os.kill(b.pid, signal.SIGKILL)
        ended = a.call(after_kill, handle)
        assert ended["other"] == [] and ended["ok"] + ended["PeerError"] == 20, ended
        assert ended["after"] == "PeerError" and ended["after_s"] < 6, ended  # peer_timeout is 2 s
        other = c.call(vmm_target, nbytes)
        assert a.call(write_again, other) == "written"
        helpers.assert_same_bits(c.call(target_bytes), helpers.random_tensor((nbytes,), torch.uint8, 7))
