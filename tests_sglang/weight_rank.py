"""An SGLang TP worker's weight path in a process of its own: a tiny model with SGLang's
``load_weights`` contract and SGLang's own ``WeightUpdater``, whose ``update_weights_from_tensor``
calls the torch_p2p custom weight loader as the server does. One JSON command a line on stdin
(rank.py's protocol)."""
from __future__ import annotations

import json
import os
import sys

# Replies go to the original stdout; libraries that print (UCX, Mooncake) get stderr.
REPLIES = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.path.insert(0, os.path.dirname(__file__))
import stubs  # noqa: E402  (before sglang)

stubs.install()

import torch  # noqa: E402

from torch_p2p.integrations.sglang.weights import LOADER  # noqa: E402


class TinyModel(torch.nn.Module):
    """Two layers; load_weights takes (name, tensor) pairs, as SGLang's models do."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)


class WeightRank:
    def __init__(self):
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.test.test_utils import published_topology

        self._topology = published_topology("scheduler", device="cpu")
        self._topology.__enter__()
        torch.manual_seed(0)
        self.model = TinyModel()
        self.updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None,
                                     custom_weight_loaders=[LOADER], get_model=lambda: self.model,
                                     update_model_fields=lambda **_: None, recapture_cuda_graph=lambda: None,
                                     get_model_runner=lambda: None)

    def update(self, text):
        """What SGLang's scheduler does with an update_weights_from_tensor request."""
        named = [("torch_p2p", torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))]
        ok, message = self.updater.update_weights_from_tensor(named, load_format=LOADER)
        return dict(ok=ok, message=message)

    def params(self):
        return {n: p.detach().double().sum().item() for n, p in self.model.named_parameters()}


def main():
    rank = WeightRank()
    print(json.dumps(dict(ready=True)), file=REPLIES, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = getattr(rank, cmd.pop("op"))(**cmd)
        except Exception as e:  # noqa: BLE001 - reported to the test (an update's failure is its result)
            reply = dict(failed=f"{type(e).__name__}: {e}")
        print(json.dumps(reply), file=REPLIES, flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
