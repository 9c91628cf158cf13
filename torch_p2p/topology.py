"""Which NICs an engine uses as rails, and which core runs its progress thread.

Policy (after pplx-garden ``fabric-lib/src/topo.rs`` and libfabric-efa-demo ``8_topo.cpp``):

- Locality is read from sysfs at run time; NIC and GPU counts are never assumed. On p5 this
  yields the 4 EFA NICs behind each GPU's PCIe switch, on p5en the 2.
- A NIC belongs to the GPU(s) with which it shares the deepest PCIe ancestor; a shared NUMA
  node breaks ties, which matters on VMs that flatten the PCIe tree. A group owned by several
  GPUs is split between them in ordinal order, so engines on one host do not share a NIC
  unless there are fewer NICs than GPUs. A GPU that owns none shares the NICs nearest to it.
- The progress thread gets a NUMA-local core: the GPUs of one node split its cores, one
  hardware thread per core, avoiding CPU 0 (it takes most interrupts). An engine claims its
  core (``claim_core``), so that engines sharing a GPU (two processes, or two engines of one)
  busy-poll on different cores: the next free core of the GPU's share, then of the node.
- Loopback is used only when it is the only NIC or is named explicitly.
- Overrides: TORCH_P2P_DOMAINS, TORCH_P2P_NUM_RAILS, TORCH_P2P_CPUS; arguments win over them.
"""

from __future__ import annotations

import glob
import os
import socket
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Nic", "Plan", "plan", "claim_core", "parse_cpulist", "gpu_pci_addresses", "line_rate_bps"]


@dataclass(frozen=True)
class Nic:
    """One libfabric domain as fi_getinfo reports it."""

    domain: str  # libfabric domain name: "rdmap16s27", "mlx5_0", "lo", "eth0", "shm"
    pci: str | None = None  # "0000:10:1b.0" from fi_info->nic->bus_attr; None if not PCI
    speed_bps: int | None = None  # fi_info->nic->link_attr->speed; None if unknown


@dataclass(frozen=True)
class Plan:
    """What an engine opens (one domain per rail) and where its progress thread runs."""

    rails: list[Nic]  # a NIC may repeat: several domains opened on one NIC
    cpu: int | None  # None: do not pin
    numa: int | None  # node of `cpu`, where the worker's allocations will land
    reason: str  # one line for the log
    node_cpus: tuple[int, ...] = ()  # the cores of node `numa`: where the worker sets up
    claim: socket.socket | None = field(default=None, compare=False, repr=False)  # see claim_core

    def release(self) -> None:
        """Gives the claimed core back (the engine closed); idempotent."""
        if self.claim is not None:
            self.claim.close()


def claim_core(cpu: int, scope: str = "torch_p2p") -> socket.socket | None:
    """Claims `cpu` for one engine's busy-polling progress thread on this host; None if another
    engine holds it. A claim is an abstract Unix socket named after the core: the kernel frees the
    name when the socket closes or its process dies, so a crashed engine leaves nothing behind.
    NOTE: two pinned workers on one core each get half of it, in slices of milliseconds, which
    more than doubles the cost of a small call.
    Claims are seen within one network namespace: containers with their own do not see each
    other's (then set TORCH_P2P_CPUS). `scope` names a separate set of claims (tests). Raises
    OSError where no Unix socket can be made (plan() then pins without claiming)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.bind(f"\0{scope}/cpu/{cpu}")
    except OSError:
        s.close()
        return None
    return s


def parse_cpulist(text: str) -> list[int]:
    """Parse the kernel's cpulist format: "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11].

    Order is kept (TORCH_P2P_CPUS is indexed by GPU ordinal); blank text gives [].
    """
    cpus: list[int] = []
    for part in filter(str.strip, text.split(",")):
        first, dash, last = part.partition("-")
        try:
            lo, hi = int(first), int(last if dash else first)
        except ValueError:
            lo, hi = -1, -1
        if lo < 0 or hi < lo:
            raise ValueError(f"bad cpulist entry {part.strip()!r} in {text.strip()!r}")
        cpus.extend(range(lo, hi + 1))
    return cpus


def gpu_pci_addresses() -> list[str]:
    """PCI addresses ("0000:bb:dd.0") of the visible GPUs, indexed by CUDA ordinal.

    Locality is an optimisation, so anything that cannot tell (CPU-only torch, no driver,
    a torch without the pci_* attributes) yields [] rather than an error.
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA setup is reported by whoever uses CUDA
        return []
    out = []
    for p in props:
        bus, dev = getattr(p, "pci_bus_id", None), getattr(p, "pci_device_id", None)
        if bus is None or dev is None:
            return []  # a partial list would shift the ordinals
        out.append(f"{getattr(p, 'pci_domain_id', 0) or 0:04x}:{bus:02x}:{dev:02x}.0")
    return out


def line_rate_bps(rails: list[Nic]) -> int | None:
    """Sum of the link speeds behind `rails`; None if any is unknown.

    A NIC opened as several rails counts once: more domains add no wire bandwidth.
    """
    nics = {n.domain: n.speed_bps for n in rails}
    return sum(nics.values()) if nics and all(nics.values()) else None  # type: ignore[arg-type]


def default_tcp_rails(cores: int | None = None) -> int:
    """Rails for a tcp engine that is not told: one per 4 cores this process may use, 1 to 8.
    NOTE: tcp moves every byte through the kernel on the rail's own threads (the provider's
    progress thread and the engine's posting thread), so rails scale with cores (the tcp rows
    of docs/performance_host.md); on 2 cores one rail is all the cores can drive."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, min(8, cores // 4))


def plan(
    nics: list[Nic],
    device: str,
    num_rails: int | None = None,
    *,
    domains: list[str] | None = None,
    cpus: list[int] | None = None,
    gpu_pcis: list[str] | None = None,
    sysfs: str = "/sys",
    allowed_cpus: set[int] | None = None,
    min_rails: int = 1,
    claim: Callable[[int], socket.socket | None] | None = None,
) -> Plan:
    """Choose rails and a progress-thread CPU for `device` ("cpu" or "cuda:N").

    `gpu_pcis` lists every visible GPU by ordinal (default: gpu_pci_addresses()): NICs
    closer to another GPU are left to that GPU's engine. Without `num_rails` there is a rail
    per chosen NIC, and at least `min_rails` (several domains on one NIC). With `claim`
    (``claim_core``: what an Engine passes) the core is the first of the GPU's share, then of
    the node, that it can claim; the plan holds the claim until ``release()``.
    """
    ordinal = _parse_device(device)
    domains, domains_src = _override(domains, "domains", "TORCH_P2P_DOMAINS", _parse_names)
    num_rails, rails_src = _override(num_rails, "num_rails", "TORCH_P2P_NUM_RAILS", int)
    cpus, cpus_src = _override(cpus, "cpus", "TORCH_P2P_CPUS", parse_cpulist)
    if num_rails is not None and num_rails < 1:
        raise ValueError(f"{rails_src} must be >= 1, got {num_rails!r}")
    if cpus is not None and (not cpus or min(cpus) < 0):
        raise ValueError(f"{cpus_src} must list CPUs >= 0, got {cpus!r}")

    candidates = _candidates(nics, domains, domains_src)
    gpu_paths: list[str | None] = []
    if ordinal is None:
        left_out = sorted({n.domain for n in nics} - {n.domain for n in candidates}) if domains is None else []
        chosen, why = candidates, f"all NICs but {', '.join(left_out)}, which never leaves the host" if left_out \
            else "all NICs"
    else:
        gpu_pcis = gpu_pci_addresses() if gpu_pcis is None else gpu_pcis
        gpu_paths = [_pci_path(sysfs, b) for b in gpu_pcis]
        chosen, why = _nics_for_gpu(candidates, ordinal, gpu_paths, sysfs)
    rails = [chosen[i % len(chosen)] for i in range(num_rails or max(len(chosen), min_rails))]

    held, shared = None, ""
    if cpus is not None:
        cpu: int | None = cpus[(ordinal or 0) % len(cpus)]
    elif ordinal is not None:
        allowed = os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus
        order = _cpus_for_gpu(ordinal, gpu_paths, sysfs, allowed)
        cpu = order[0] if order else None
        if claim is not None and order:
            try:
                cpu, held = next(((c, h) for c in order if (h := claim(c)) is not None), (cpu, None))
                if held is None:
                    shared = " (shared: another engine holds every core of the node)"
            except OSError as e:
                shared = f" (not claimed: {e})"
    else:
        cpu = None  # a host-memory engine has no device to be near
    numa = None if cpu is None else _numa_of_cpu(sysfs, cpu)
    node_cpus = () if numa is None else tuple(parse_cpulist(_read(f"{sysfs}/devices/system/node/node{numa}/cpulist")))
    where = "no cpu pinning" if cpu is None else f"cpu {cpu}{shared}"
    if cpus is not None:
        where += f" from {cpus_src}"
    if cpu is not None:
        where += f" on numa {numa}" if numa is not None else " (numa unknown)"
    names = ", ".join(dict.fromkeys(r.domain for r in rails))
    s = "" if len(rails) == 1 else "s"
    return Plan(rails, cpu, numa, f"{device} -> {len(rails)} rail{s} [{names}] ({why}), {where}", node_cpus, held)


def _parse_device(device: str) -> int | None:
    device = str(device)  # also accepts a torch.device
    kind, _, index = device.partition(":")
    if device == "cpu" or (kind == "cuda" and index.isdigit()):
        return None if device == "cpu" else int(index)
    raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")


def _parse_names(text: str) -> list[str]:
    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names:
        raise ValueError("no domain names")
    return names


def _override(value, arg: str, var: str, parse):
    """(value, where it came from). An unset or blank variable is no override."""
    raw = os.environ.get(var, "").strip()
    if value is not None or not raw:
        return value, arg
    try:
        return parse(raw), var
    except ValueError as e:
        raise ValueError(f"{var}={raw!r} is invalid: {e}") from None


def _candidates(nics: list[Nic], domains: list[str] | None, source: str) -> list[Nic]:
    # libfabric lists a domain once per address family; its first entry stands for it.
    unique: dict[str, Nic] = {}
    for nic in nics:
        unique.setdefault(nic.domain, nic)
    if not unique:
        raise ValueError("no NICs to choose rails from")
    if domains is not None:
        missing = [d for d in domains if d not in unique]
        if missing or not domains:
            raise ValueError(f"{source} names unknown domain(s) {missing or domains}; "
                             f"available: {list(unique)}")
        return [unique[d] for d in dict.fromkeys(domains)]
    # Loopback never leaves the host: picking it next to a real NIC would cut off remote peers.
    return [n for n in unique.values() if n.domain != "lo"] or list(unique.values())


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pci_path(sysfs: str, bdf: str | None) -> str | None:
    """The device's place in the PCIe tree: /sys/devices/pci0000:00/0000:00:01.0/.../<bdf>."""
    link = f"{sysfs}/bus/pci/devices/{(bdf or '').lower()}"
    return os.path.realpath(link) if bdf and os.path.exists(link) else None


def _nic_path(sysfs: str, nic: Nic) -> str | None:
    # Providers that leave fi_info->nic empty (tcp, some verbs setups) still have a PCI
    # device behind the interface name.
    links = [f"{sysfs}/class/{cls}/{nic.domain}/device" for cls in ("infiniband", "net")]
    found = (os.path.realpath(p) for p in links if os.path.exists(p))
    return _pci_path(sysfs, nic.pci) or next(found, None)


def _numa_of(path: str | None) -> int | None:
    text = _read(f"{path}/numa_node") if path else ""
    return int(text) if text.isdigit() else None  # the kernel writes -1 when it does not know


def _nics_for_gpu(candidates: list[Nic], ordinal: int, gpu_paths: list[str | None], sysfs: str):
    mine = gpu_paths[ordinal] if ordinal < len(gpu_paths) else None
    located = [(n, p) for n in candidates if mine and (p := _nic_path(sysfs, n))]
    if mine is None or not located:
        return candidates, f"PCIe locality of cuda:{ordinal} or its NICs unknown, all NICs"
    gpu_numa = [_numa_of(p) for p in gpu_paths]

    def affinity(g: int, nic_path: str) -> tuple[int, bool]:
        nic_numa = _numa_of(nic_path)
        same_node = nic_numa is not None and nic_numa == gpu_numa[g]
        depth = len(os.path.commonpath([gpu_paths[g] or "/", nic_path]).split("/"))
        return depth, same_node

    # Group NICs by the GPUs closest to them; PCI order makes each GPU's share deterministic.
    groups: dict[tuple[int, ...], list[Nic]] = {}
    for nic, path in sorted(located, key=lambda x: (x[0].pci or "", x[1])):
        scores = {g: affinity(g, path) for g, gp in enumerate(gpu_paths) if gp}
        owners = tuple(g for g, s in scores.items() if s == max(scores.values()))
        groups.setdefault(owners, []).append(nic)
    own: list[Nic] = []
    sharers: set[int] = set()
    for owners, group in groups.items():
        if ordinal in owners:
            k, m, n = owners.index(ordinal), len(owners), len(group)
            own += group[k * n // m : (k + 1) * n // m] if n >= m else [group[k % n]]
            sharers.update(owners)
    gpu = os.path.basename(mine)
    if own:
        parent = os.path.basename(os.path.commonpath([mine] + [p for n, p in located if n in own]))
        why = f"under PCIe {parent} with GPU {gpu}" if ":" in parent else f"nearest to GPU {gpu}"
        if len(sharers) > 1:
            why += f", split with cuda:{','.join(str(g) for g in sorted(sharers - {ordinal}))}"
    else:
        # Every NIC is closer to another GPU: sharing the nearest beats running without one.
        best = max(affinity(ordinal, p) for _, p in located)
        own = [n for n, p in located if affinity(ordinal, p) == best]
        why = f"GPU {gpu} owns no NIC, sharing the nearest"
    return [n for n in candidates if n in own], why


def _cpus_for_gpu(ordinal: int, gpu_paths: list[str | None], sysfs: str, allowed: set[int]) -> list[int]:
    """The cores a GPU's progress thread may take, best first: its contiguous share of its
    node's cores, then the rest of the node (the same share order the other GPUs start from)."""
    gpu_numa = [_numa_of(p) for p in gpu_paths]
    node = gpu_numa[ordinal] if ordinal < len(gpu_numa) else None
    pool: list[int] = []
    if node is not None:
        node_cpus = parse_cpulist(_read(f"{sysfs}/devices/system/node/node{node}/cpulist"))
        pool = [c for c in node_cpus if c in allowed]
    peers = [g for g, n in enumerate(gpu_numa) if n == node]
    if not pool:  # no NUMA information, or the affinity mask excludes the GPU's node
        pool, peers = sorted(allowed), list(range(max(len(gpu_paths), ordinal + 1)))
    pool = _one_thread_per_core(sysfs, pool)
    if len(pool) > 1 and 0 in pool:
        pool.remove(0)
    # This GPU's contiguous share of the node first (pplx-garden splits cores per GPU the same
    # way), the share's first core best: the rest of it is for the GPU's other threads.
    start = peers.index(ordinal) * len(pool) // len(peers) if pool else 0
    return pool[start:] + pool[:start]


def _one_thread_per_core(sysfs: str, pool: list[int]) -> list[int]:
    # Busy-polling threads on two SMT siblings would compete for one core.
    members = set(pool)
    out = []
    for c in pool:
        siblings = parse_cpulist(_read(f"{sysfs}/devices/system/cpu/cpu{c}/topology/"
                                       "thread_siblings_list"))
        if not any(s < c and s in members for s in siblings):
            out.append(c)
    return out


def _numa_of_cpu(sysfs: str, cpu: int) -> int | None:
    for path in glob.glob(f"{sysfs}/devices/system/node/node*/cpulist"):
        node = os.path.basename(os.path.dirname(path))[4:]
        if node.isdigit() and cpu in parse_cpulist(_read(path)):
            return int(node)
    return None
