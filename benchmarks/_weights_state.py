"""What each process of weights.py holds: its device and engine, and a model's state dict (the
published shapes, cut to the memory each process may fill), checksummed bit for bit."""
from __future__ import annotations

import math

import torch

import torch_p2p as p2p

# (vocab, hidden, layers, heads, kv heads, head dim, intermediate, tied embeddings, qkv bias):
# the models' published configs.
PRESETS = {
    "llama3-8b": (128256, 4096, 32, 32, 8, 128, 14336, False, False),
    "llama3-70b": (128256, 8192, 80, 64, 8, 128, 28672, False, False),
    "llama3.2-1b": (128256, 2048, 16, 32, 8, 64, 8192, True, False),
    "qwen2.5-0.5b": (151936, 896, 24, 14, 2, 64, 4864, True, True),
    "tiny": (1024, 256, 2, 4, 2, 64, 512, False, False),
}
DEFAULT_MODELS = ("llama3-8b", "llama3.2-1b", "qwen2.5-0.5b", "tiny")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shapes(model: str, layers: int | None) -> dict[str, tuple]:
    vocab, hidden, n_layers, heads, kv, head_dim, inter, tied, _ = PRESETS[model]
    out = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(n_layers if layers is None else layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
                    p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
                    p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                    p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter),
                    p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
        if PRESETS[model][8]:
            out.update({p + "self_attn.q_proj.bias": (heads * head_dim,), p + "self_attn.k_proj.bias": (kv * head_dim,),
                        p + "self_attn.v_proj.bias": (kv * head_dim,)})
    out["model.norm.weight"] = (hidden,)
    if not tied:
        out["lm_head.weight"] = (vocab, hidden)
    return out


USABLE = 0.8  # of a device's free memory: the rest is for CUDA contexts, NCCL and the engines
# On host memory time, not memory, bounds a default run: gloo moves about 1.5 GB/s on two cores,
# and each row pushes four updates to up to three destinations: 2 GiB per process (most of
# llama3.2-1b) keeps a default run within a couple of minutes.
HOST_DEFAULT_BYTES = 2 << 30
CHECK_ELEMS = 1 << 24  # checksum() converts this many elements at a time


def free_bytes(device: str) -> int:
    """A device's free memory, or the host's available memory."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def process_budget(devices: list[str], free=free_bytes) -> int:
    """Bytes each process may fill: `devices[i]` is process i's device, and the processes on one
    device (all of them on host memory) share its free memory; the least share of any device.
    On host memory at most HOST_DEFAULT_BYTES."""
    share = min(int(free(d) * USABLE) // devices.count(d) for d in set(devices))
    on_host = all(torch.device(d).type == "cpu" for d in devices)
    return min(share, HOST_DEFAULT_BYTES) if on_host else share


def process_bytes(spec: dict, elem: int, bucket: int) -> int:
    """What one process holds at its peak: its tensors, the baseline's bucket and checksum()'s
    int64 copy of one slice."""
    return sum(math.prod(s) for s in spec.values()) * elem + bucket + CHECK_ELEMS * 8


def fit_layers(args, model: str, budget: int) -> int | None:
    """The most decoder layers of `model` that fit in `budget` bytes per process: None when the
    whole model fits, 0 when not even one layer does."""
    elem = max(DTYPES[args.dtype].itemsize, DTYPES[args.source_dtype or args.dtype].itemsize)
    full = PRESETS[model][2]
    fits = [n for n in range(1, full + 1) if process_bytes(shapes(model, n), elem, args.bucket) <= budget]
    if full in fits:
        return None
    return max(fits, default=0)


def state_dict(spec: dict, dtype, device, fill: bool) -> dict[str, torch.Tensor]:
    """Host tensors go to shared memory, which the cma route maps between processes of one
    host (its memcpy path; private memory takes the kernel's cross-memory copies)."""
    out = {}
    for name, shape in spec.items():
        t = torch.empty(shape, dtype=dtype, device=device)
        t.normal_(0, 0.02) if fill else t.zero_()
        out[name] = t.share_memory_() if t.device.type == "cpu" else t
    return out


def checksum(tensors, dtype) -> int:
    """Order-independent sum of the bits of every tensor as `dtype` (bitwise check), a slice of
    CHECK_ELEMS at a time (bounded memory)."""
    ints = {2: torch.int16, 4: torch.int32}[torch.empty((), dtype=dtype).element_size()]
    total = 0
    for t in tensors:
        flat = t.reshape(-1)
        for at in range(0, flat.numel(), CHECK_ELEMS):
            total += int(flat[at:at + CHECK_ELEMS].to(dtype).view(ints).to(torch.int64).sum())
    return total


def open_engine(args, device: str) -> p2p.Engine:
    """On loopback: tcp stays on "lo"; --no-ipc sends GPU memory over the provider."""
    return p2p.Engine(device, args.provider, args.rails, domains=["lo"] if args.provider == "tcp" else None,
                      ipc=False if args.no_ipc else None)


def device_of(base: str, i: int) -> str:
    dev = torch.device(base)
    if dev.type != "cuda":
        return "cpu"
    return f"cuda:{((dev.index or 0) + i) % torch.cuda.device_count()}"
