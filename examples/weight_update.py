"""A trainer pushes fresh weights to inference processes after every optimizer step
(torch_p2p.weights), and each checks its outputs against the trainer's for that version.

    python examples/weight_update.py                   # GPUs round robin if any (one is enough)
    python examples/weight_update.py --device cpu      # host memory (the cma route between processes)

Processes: the trainer (this one: a transformers Llama with random weights, fp32, whole
tensors) and inference processes that receive each version:
  replica-a          fp32, whole tensors
  replica-b          fp32, whole tensors (relays with replica-a); leaves after version 2
  tp-0, tp-1         fp32, one tensor-parallel replica of two ranks (column-parallel q/k/v,
                     gate/up, embeddings, lm_head split on dim 0, o/down on dim 1, norms
                     replicated); tp-1 hands its shards to tp-0, which computes the outputs
  replica-c          bf16, whole tensors (converted on the way); joins after version 2
Each compares its logits on a fixed input with the trainer's for the same version, bitwise
(the trainer computes the bf16 reference with a bf16 copy of its model).
"""
import argparse
import copy
import multiprocessing as mp
from multiprocessing import forkserver

import torch

import torch_p2p as p2p
import torch_p2p.weights as pw

VERSIONS = 4
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def build_model(dtype=torch.float32):
    import transformers

    torch.manual_seed(0)  # random weights, built here: nothing is downloaded
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def fixed_input(device) -> torch.Tensor:
    return (torch.arange(24, device=device) * 7 % 256)[None]


@torch.no_grad()
def logits(model, device) -> torch.Tensor:
    return model(fixed_input(device)).logits.cpu()


def tp_dim(name: str):
    if any(k in name for k in COLUMN):
        return 0
    if any(k in name for k in ROW):
        return 1
    return None  # replicated


def answer(conn):
    """The inference process's next word (no example should hang on a crashed child)."""
    if not conn.poll(120):
        raise RuntimeError("an inference process did not answer within 120 s")
    return conn.recv()


def engine_for(args, device) -> p2p.Engine:
    return p2p.Engine(device, args.provider, domains=["lo"] if args.provider == "tcp" else None)


def inference(name: str, conn, args, device: str, rank_pipe=None) -> None:
    """One inference process: joins, then checks each version the trainer asks about."""
    torch.set_num_threads(1)  # the same reduction order as the trainer's: bitwise equal outputs
    dtype = torch.bfloat16 if name == "replica-c" else torch.float32
    model = build_model(dtype).to(device)
    state = model.state_dict()
    if name.startswith("tp-"):
        rank = int(name[3:])
        shards = {n: pw.split(t, tp_dim(n), rank, 2) if tp_dim(n) is not None else pw.Shard(t)
                  for n, t in state.items()}
        shards = {n: pw.Shard(s.tensor.clone(), s.shape, s.offset) for n, s in shards.items()}  # own memory
    else:
        shards = pw.whole(state)
    with engine_for(args, device) as engine:
        dest = pw.WeightDestination(engine, shards, args.leader, name=name)
        dest.join().wait()
        conn.send("joined")
        while (msg := conn.recv()) != "bye":
            if msg == "leave":
                conn.send(dest.leave().wait())
                continue
            version, reference = msg
            dest.wait_for(version).wait()
            if name == "tp-1":
                # Copies: pickling a tensor for another process moves its storage to shared
                # memory, which would free the registered memory under the engine.
                rank_pipe.send({n: s.tensor.cpu().clone() for n, s in shards.items()})
                conn.send((name, version, None))
                continue
            if name == "tp-0":  # assemble the replica's two halves to run the model here
                theirs = rank_pipe.recv()
                for n, s in shards.items():
                    d = tp_dim(n)
                    state[n].copy_(s.tensor if d is None else torch.cat([s.tensor, theirs[n].to(device)], d))
            out = logits(model, device)
            conn.send((name, version, torch.equal(out, reference[dtype])))
        dest.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (GPUs round robin from cuda:0; the default when there is one)")
    parser.add_argument("--provider", default="tcp", help="libfabric provider (default tcp, on loopback)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0

    def device(i: int) -> str:
        return f"cuda:{i % gpus}" if gpus else "cpu"

    # Every inference process needs torch and transformers, several seconds of CPU to import
    # each: a fork server (a fresh process, none of this one's engine threads) imports them
    # once, while this process builds its model, and forks every inference process from itself.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers.models.llama.modeling_llama", "torch_p2p.weights"])
    forkserver.ensure_running()

    torch.set_num_threads(1)
    model = build_model().to(device(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = engine_for(args, device(0))
    source = pw.WeightSource(engine, pw.whole(model.state_dict()))
    args.leader = source.address
    procs, conns = {}, {}

    def start(name: str, i: int, rank_pipe=None) -> None:
        mine, theirs = ctx.Pipe()
        procs[name] = ctx.Process(target=inference, args=(name, theirs, args, device(i), rank_pipe), daemon=True)
        procs[name].start()
        theirs.close()  # the child's end: once the child dies, recv() here raises EOFError
        conns[name] = mine

    tp_a, tp_b = ctx.Pipe()
    for i, (name, pipe) in enumerate([("replica-a", None), ("replica-b", None), ("tp-0", tp_a), ("tp-1", tp_b)]):
        start(name, i + 1, pipe)
    tp_a.close(), tp_b.close()  # the two tensor-parallel ranks' own pipe
    for name in list(conns):
        assert answer(conns[name]) == "joined"
    ok = True
    try:
        batch = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1)).to(device(0))
        for version in range(1, VERSIONS + 1):
            loss = model(batch, labels=batch).loss
            loss.backward()
            optimizer.step()  # the previous push completed: the weights may change
            optimizer.zero_grad()
            result = source.push().wait()
            reference = {torch.float32: logits(model, device(0)),
                         torch.bfloat16: logits(copy.deepcopy(model).to(torch.bfloat16), device(0))}
            for name in conns:
                conns[name].send((version, reference))
            checks = [answer(conns[name]) for name in conns]
            print(f"version {version}: loss {loss.item():.4f}, to {sorted(result.received)} in "
                  f"{result.seconds * 1e3:.1f} ms, dropped {result.dropped or 'none'}")
            for name, v, equal in checks:
                if equal is not None:
                    print(f"  {name}: outputs {'bitwise equal to' if equal else 'DIFFER from'} the trainer's")
                    ok &= equal
            if version == 2:  # membership changes between versions
                conns["replica-b"].send("leave")
                print(f"  replica-b left, holding version {answer(conns['replica-b'])}")
                conns.pop("replica-b").send("bye")
                start("replica-c", 5)
                assert answer(conns["replica-c"]) == "joined"
                print("  replica-c (bf16) joined")
    finally:
        for conn in conns.values():
            conn.send("bye")
        for proc in procs.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        source.close()
        engine.close()
    print("ok" if ok else "FAILED: some outputs differ")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
