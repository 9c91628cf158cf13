"""A request's KV cache migrates from a prefill process to a decode process, on a real
transformer: a small Llama from `transformers`, built from a config with random weights in
both processes (the same seed; nothing is downloaded).

    python examples/kv_migration.py                          # a GPU and the next one, else host memory
    python examples/kv_migration.py --provider shm
    python examples/kv_migration.py --device cuda:0 --peer-device cuda:1

This process prefills, a child process decodes; each holds a paged KV cache in vLLM's
FlashAttention layout ([2, blocks, block_size, kv_heads, head_dim] per layer) with its own
block table. Two requests:
  push  the decode side names its blocks; each layer goes out right after that layer's forward
        (a forward hook), so the transfer overlaps the rest of the prefill; the decode side
        waits for one notification per layer.
  pull  the prefill side finishes the prompt and names its blocks; the decode side reads them
        and tells the prefill side, which frees them.
The decode side rebuilds the model's cache from its blocks and generates greedily. Its tokens
must equal those of the same model prefilling and generating in one process (this one, on its
own cache: the same calls, so any difference comes from the migration).

Control messages (block ids, first token, generated tokens) travel through the engines'
send/recv; the cache handles through a pipe, once.
"""
import argparse
import json
import multiprocessing as mp

import torch

import torch_p2p as p2p
from torch_p2p import kv

BLOCK = 16
NEW_TOKENS = 12
PROMPTS = {"push": 37, "pull": 50}  # tokens: partial last blocks


def build_model(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, initializer_range=0.1,
                         pad_token_id=0)
    torch.manual_seed(0)  # the same weights in both processes
    return LlamaForCausalLM(config).eval().to(device), config


def paged_cache(engine: p2p.Engine, config, blocks: int):
    layers = [torch.zeros(2, blocks, BLOCK, config.num_key_value_heads, config.head_dim, device=engine.device)
              for _ in range(config.num_hidden_layers)]
    return layers, kv.KVCache(engine, layers, "flash_attn")


class BlockTable:
    """A free list handing out blocks in a shuffled order, as a block manager after a while."""

    def __init__(self, blocks: int, seed: int):
        self.free = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def take(self, tokens: int) -> list[int]:
        n = -(-tokens // BLOCK)
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give(self, blocks: list[int]) -> None:
        self.free += blocks


def store(layer: torch.Tensor, blocks: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
    """K and V of one layer ([1, heads, tokens, dim], the model's cache) into `blocks`."""
    tokens = keys.shape[2]
    for i, x in enumerate((keys, values)):
        padded = x.new_zeros(len(blocks) * BLOCK, x.shape[1], x.shape[3])
        padded[:tokens] = x[0].transpose(0, 1)
        layer[i, blocks] = padded.view(len(blocks), BLOCK, x.shape[1], x.shape[3])


def load(layer: torch.Tensor, blocks: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of store(): [1, heads, tokens, dim] K and V from `blocks`."""
    return tuple(layer[i, blocks].flatten(0, 1)[:tokens].transpose(0, 1)[None].contiguous() for i in (0, 1))


def cache_arg(model, past) -> dict:
    """The model's cache argument: `cache` from transformers 5.24 on (which warns that
    `past_key_values` is deprecated), `past_key_values` before."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": past}


def prefill(model, prompt: torch.Tensor, layers: list, blocks: list[int], stream=None) -> int:
    """Runs the prompt; each layer's K and V land in `blocks` right after its forward (and with
    a PushStream, go to the peer then). Returns the first generated token."""
    from transformers import DynamicCache

    past = DynamicCache(config=model.config)

    def after_layer(i):
        def hook(module, args, output):
            store(layers[i], blocks, past.layers[i].keys, past.layers[i].values)
            if stream is not None:
                stream.push(i)  # ordered after the copy above by the current CUDA stream
        return hook

    hooks = [layer.register_forward_hook(after_layer(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            logits = model(prompt, use_cache=True, **cache_arg(model, past)).logits
    finally:
        for h in hooks:
            h.remove()
    return int(logits[0, -1].argmax())


def rebuild(config, layers: list, blocks: list[int], tokens: int):
    """The model's cache, out of `blocks` of the paged cache."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[load(layer, blocks, tokens) for layer in layers], config=config)


def greedy(model, past, first: int) -> list[int]:
    """NEW_TOKENS tokens, greedily, from `first` and the cache of what came before."""
    out = [first]
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(NEW_TOKENS - 1):
            logits = model(torch.tensor([[out[-1]]], device=device), use_cache=True, **cache_arg(model, past)).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def one_process(model, prompt: torch.Tensor) -> list[int]:
    """The reference: prefill and decode in this process, on the model's own cache."""
    from transformers import DynamicCache

    past = DynamicCache(config=model.config)
    with torch.no_grad():
        first = int(model(prompt, use_cache=True, **cache_arg(model, past)).logits[0, -1].argmax())
    return greedy(model, past, first)


def engine_args(provider: str) -> dict:
    return dict(provider=provider, domains=["lo"] if provider == "tcp" else None)


def message(engine: p2p.Engine) -> tuple[bytes, dict]:
    address, payload = p2p.wait(engine.recv(), 120)
    return address, json.loads(payload)


def send(engine: p2p.Engine, address: bytes, **msg) -> None:
    p2p.wait(engine.send(address, json.dumps(msg).encode()), 60)


def decode_process(conn, provider: str, device: str) -> None:
    """The decode side: answers requests until "bye"."""
    model, config = build_model(device)
    with p2p.Engine(device, **engine_args(provider)) as engine:
        layers, cache = paged_cache(engine, config, blocks=48)
        table = BlockTable(48, seed=2)
        conn.send(cache.handle.to_bytes())
        peer = kv.KVCacheHandle.from_bytes(conn.recv())
        while True:
            prefill_address, msg = message(engine)
            if msg["op"] == "bye":
                break
            blocks = table.take(msg["tokens"])
            if msg["op"] == "push":
                arrived = cache.notification(msg["tag"], count=cache.num_layers, timeout=60)
                send(engine, prefill_address, blocks=blocks)
                first = message(engine)[1]["first"]
                p2p.wait(arrived, 60)  # every layer is here
            else:
                first = msg["first"]
                p2p.wait(cache.pull(peer, msg["blocks"], blocks, notify=msg["tag"]), 60)
            past = rebuild(config, layers, blocks, msg["tokens"])
            send(engine, prefill_address, tokens=greedy(model, past, first))
            table.give(blocks)
        cache.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", default="tcp")
    gpus = torch.cuda.device_count()  # a GPU when there is one; the second one for the peer
    parser.add_argument("--device", default="cuda:0" if gpus else "cpu", help="the prefill process's device")
    parser.add_argument("--peer-device", default=f"cuda:{min(1, gpus - 1)}" if gpus else "cpu",
                        help="the decode process's device")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=decode_process, args=(child_conn, args.provider, args.peer_device))
    child.start()
    child_conn.close()  # the child's end: if the child dies, conn.recv() raises EOFError instead of waiting
    try:
        model, config = build_model(args.device)
        with p2p.Engine(args.device, **engine_args(args.provider)) as engine:
            layers, cache = paged_cache(engine, config, blocks=64)
            table = BlockTable(64, seed=1)
            conn.send(cache.handle.to_bytes())
            peer = kv.KVCacheHandle.from_bytes(conn.recv())
            route = engine.route(peer.mailbox)
            over = "" if route in ("ipc", "cma") else f" over {engine.provider}"
            print(f"prefill on {args.device}, decode on {args.peer_device}, route {route}{over}; {cache}")
            for tag, (op, tokens) in enumerate(PROMPTS.items(), start=1):
                prompt = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tag))
                prompt = prompt.to(args.device)
                blocks = table.take(tokens)
                if op == "push":
                    send(engine, peer.owner, op=op, tokens=tokens, tag=tag)
                    theirs = message(engine)[1]["blocks"]
                    stream = cache.stream(peer, blocks, theirs, notify=tag)
                    first = prefill(model, prompt, layers, blocks, stream)
                    send(engine, peer.owner, first=first)
                    p2p.wait(stream.future(), 60)  # our blocks are free once every layer landed
                else:
                    first = prefill(model, prompt, layers, blocks)
                    if engine.device.type == "cuda":
                        torch.cuda.synchronize(engine.device)  # the blocks hold the prompt before the peer reads
                    released = cache.notification(tag, timeout=60)
                    send(engine, peer.owner, op=op, tokens=tokens, tag=tag, blocks=blocks, first=first)
                    p2p.wait(released, 60)  # the decode side has read them
                table.give(blocks)
                got = message(engine)[1]["tokens"]
                want = one_process(model, prompt)
                print(f"{op}: {len(blocks)} blocks, decoded {got}")
                assert got == want, f"{op}: the decode process generated {got}, one process generates {want}"
                print(f"{op}: tokens match generation in one process")
            send(engine, peer.owner, op="bye")
            cache.close()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()


if __name__ == "__main__":
    main()
