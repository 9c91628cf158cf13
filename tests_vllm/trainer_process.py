"""A trainer in a process of its own that SIGKILLs itself at one point of a weight update, for
test_weight_transfer: it connects to a vLLM server (WeightTrainer, no vLLM import), pauses it
and sends the weights of MODEL_DIR, dying at POINT:

    python trainer_process.py URL MODEL_DIR POINT

POINT: "push" (once the first of the push's chunks has been written), "start" (once
start_weight_update has returned) or "update" (once update_weights has returned)."""
from __future__ import annotations

import os
import signal
import sys


def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    from safetensors.torch import load_file

    import torch_p2p
    from torch_p2p.integrations.vllm.weight_trainer import HTTPClient, WeightTrainer

    url, model_dir, point = sys.argv[1:4]
    client = HTTPClient(url)
    # Small chunks: the push of the tiny model is many chunks, and dies after the first.
    trainer = WeightTrainer(load_file(os.path.join(model_dir, "model.safetensors")), [client], chunk_bytes=64 << 10)
    if point == "push":
        write = torch_p2p.Engine.write_slices

        def write_then_die(self, *args, **kwargs):
            fut = write(self, *args, **kwargs)
            fut.add_done_callback(die)
            return fut
        torch_p2p.Engine.write_slices = write_then_die
    else:
        method = {"start": "start_weight_update", "update": "update_weights"}[point]
        call = getattr(client, method)
        setattr(client, method, lambda *args, **kwargs: (call(*args, **kwargs), die()))
    client.pause()
    trainer.send_weights()
    raise AssertionError(f"the trainer lived past {point!r}")


if __name__ == "__main__":
    main()
