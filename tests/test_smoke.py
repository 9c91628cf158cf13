"""The smallest end-to-end check, per provider: one write and one read between two processes."""
import torch

import helpers
import torch_p2p as p2p
from conftest import engine_kwargs
from peer import Peer


def test_write_then_read(provider):
    with Peer() as b, p2p.Engine("cpu", **engine_kwargs(provider)) as a:
        b.call(helpers.start_engine, provider)
        remote = p2p.RemoteTensor.from_bytes(b.call(helpers.make_target, "t", (8, 256)))
        src = torch.randn(8, 256)
        out = torch.zeros(8, 256)
        a.register(src)
        a.register(out)
        a.write_slices(src[2], [remote[5]]).wait()
        got = b.call(helpers.fetch, "t")
        assert torch.equal(got[5], src[2])
        assert (got[torch.arange(8) != 5] == -1).all()
        a.read_slices(out[0], [remote[5]]).wait()
        assert torch.equal(out[0], src[2])
