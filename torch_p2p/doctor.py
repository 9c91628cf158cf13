"""What this machine offers torch_p2p, the plan each GPU would get, and what to fix.

``python -m torch_p2p.doctor`` (or ``torch-p2p-doctor``) is the first thing to run on a new
machine. ``--check`` also moves data over each route this machine has, beside a same-run
memcpy of the same bytes; ``--json`` prints the report for scripts. docs/doctor.md explains
each warning.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

from . import _C, topology

PROVIDERS = tuple(_C.provider_names())  # the profile table's (csrc/fabric/profile.h)
DEFAULT_ORDER = tuple(_C.default_providers())  # what Engine(provider=None) tries, in order


def providers(query: Callable[[str], dict] = _C.provider_limits) -> dict[str, dict[str, Any]]:
    """Each provider's limits and NICs as the engine's query sees them, or {"error": why}."""
    found = {}
    for name in PROVIDERS:
        try:
            found[name] = query(name)
        except Exception as e:  # noqa: BLE001 - a provider that is absent says why
            found[name] = {"error": str(e).splitlines()[0]}
    return found


def default_provider(offers: dict[str, dict[str, Any]], env: dict[str, str]) -> str | None:
    chosen = env.get("TORCH_P2P_PROVIDER")
    if chosen:
        return chosen.split(";")[0]
    return next((p for p in DEFAULT_ORDER if "error" not in offers.get(p, {"error": ""})), None)


def gpu_plans(offer: dict[str, Any] | None, gpu_pcis: list[str], sysfs: str = "/sys",
              allowed_cpus: set[int] | None = None) -> list[dict[str, Any]]:
    """The rails and core each GPU's engine would get from the default provider's NICs."""
    nics = [topology.Nic(n["domain"], n.get("pci"), n.get("speed_bps")) for n in (offer or {}).get("nics", [])]
    plans = []
    for g in range(len(gpu_pcis)):
        row: dict[str, Any] = {"device": f"cuda:{g}", "pci": gpu_pcis[g]}
        try:
            kw = dict(gpu_pcis=gpu_pcis, sysfs=sysfs, allowed_cpus=allowed_cpus)
            p = topology.plan(nics, f"cuda:{g}", **kw)
            # As many rails as NICs listed covers every NIC the GPU would take, whatever
            # TORCH_P2P_NUM_RAILS says.
            near = topology.plan(nics, f"cuda:{g}", len(nics), **kw).rails
            row.update(rails=[n.domain for n in p.rails], cpu=p.cpu, numa=p.numa, reason=p.reason,
                       line_rate_bps=topology.line_rate_bps(p.rails),
                       own_nic="owns no NIC" not in p.reason and "unknown" not in p.reason,
                       nics_near=len({n.domain for n in near}))
        except ValueError as e:
            row["error"] = str(e)
        plans.append(row)
    return plans


def gpu_registration(provider: str, offer: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """How an engine on `provider` registers GPU memory with its NICs (csrc/fabric/registration.h):
    for cudaMalloc'd memory and for VMM memory (expandable segments), (how, why): "dmabuf"
    (FI_MR_DMABUF, libfabric >= 1.20 on efa/verbs: no nvidia-peermem), "hmem" (FI_HMEM_CUDA,
    needs nvidia-peermem), "staged" (pinned host slots)."""
    return {kind: tuple(_C.registration(provider, bool(offer.get("hmem")), bool(offer.get("dmabuf")), memory))
            for kind, memory in (("cuda", "cuda"), ("vmm", "cuda_vmm"))}


def host_plan(provider: str | None, offer: dict[str, Any] | None) -> str | None:
    """The rails a host-memory engine opens on `provider` (as Engine does it): its NICs but
    loopback, and on tcp one rail per 4 cores (topology.default_tcp_rails)."""
    if offer is None:
        return None
    nics = [topology.Nic(n["domain"], n.get("pci"), n.get("speed_bps")) for n in offer.get("nics", [])]
    rails_from_cores = _C.provider_profile(provider)["rails_from_cores"]
    try:
        return topology.plan(nics, "cpu", min_rails=topology.default_tcp_rails() if rails_from_cores else 1).reason
    except ValueError as e:
        return f"no plan ({e})"


def ptrace_scope() -> int:
    """Yama's kernel.yama.ptrace_scope (0 without Yama): 2 and 3 keep the cma route off."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def ptrace_consent(scope: int, env: dict[str, str]) -> str:
    """What an engine's cma route lets other processes do to its process
    (csrc/routes/host_cma/ptrace_consent.h)."""
    if env.get("TORCH_P2P_CMA", "1") == "0" or scope >= 2:
        return "the cma route is off: engines open their process to no one"
    if scope == 0:
        return ("no Yama consent needed (scope 0 or no Yama): every process of this user may read and write "
                "any other, engine or not")
    if env.get("TORCH_P2P_CMA_PTRACE") == "any":
        return "TORCH_P2P_CMA_PTRACE=any: an engine's process lets every process of this user read and write it"
    return ("scope 1: an engine's process lets one same-host peer read and write it (the first that copies its "
            "private host memory); tensors in shared memory reach every peer as descriptors, without consent")


def routes(gpus: int, peer_access: Callable[[int, int], bool], offer: dict[str, Any] | None,
           env: dict[str, str], scope: int = 0) -> list[dict[str, Any]]:
    """The route a transfer between each pair of devices of this host takes (and to another host)."""
    ipc = env.get("TORCH_P2P_IPC", "1") != "0"
    fabric = f"{offer['provider']}, " if offer else ""
    host = f"{fabric}direct" if offer else "none"
    gpu = f"{fabric}{'direct' if offer and offer.get('hmem') else 'staged'}" if offer else "none"
    cma = env.get("TORCH_P2P_CMA", "1") != "0" and scope < 2  # Yama: see diagnose()
    rows = [{"from": "cpu", "to": "cpu", "route": "cma" if cma and offer else host},
            {"from": "cpu", "to": "another host", "route": host}]
    for i in range(gpus):
        for j in range(gpus):
            rows.append({"from": f"cuda:{i}", "to": f"cuda:{j}",
                         "route": "ipc" if ipc and (i == j or peer_access(i, j)) else gpu})
        rows.append({"from": f"cuda:{i}", "to": "another host", "route": gpu})
    return rows


# How each provider stops a failed call (docs/failures.md, "A failed call has stopped").
FAILED_CALLS = {
    "efa": "the NIC completes or fails what was posted; an owner cannot revoke the keys a peer it gave up "
           "on holds (connectionless), so RMA a stopped peer posted before it stopped can land when it resumes",
    "verbs": "a dead peer's connections are cut: what was posted to it is flushed, and it can no longer reach us",
    "tcp": "a dead peer's connections are cut: what was posted to it is flushed, and it can no longer reach us",
    "shm": "cannot cancel: what a stopped peer has not served is given up 2 s after its failure, and may still "
           "move when it resumes",
}


def failed_calls(provider: str | None, env: dict[str, str]) -> str | None:
    """How a failed call to a peer of `provider` stops moving bytes, as this process will do it."""
    if provider is None:
        return None
    if env.get("FI_AV_REMOVE_CLEANUP", "1") in ("0", "false", "no"):
        return "not stopped: FI_AV_REMOVE_CLEANUP is off, so a dead peer's connections stay"
    how = FAILED_CALLS.get(provider.split(";")[0])
    if provider.startswith("tcp") and _C.libfabric_version() < (1, 18):
        how += (f"; libfabric {'.'.join(map(str, _C.libfabric_version()))}'s tcp may crash cutting a connection with a "
                "read response half received (fixed in 1.18)")
    return how


def settings(env: dict[str, str]) -> dict[str, str]:
    """TORCH_P2P_* and the FI_* variables that change what the engine gets."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(("TORCH_P2P_", "FI_"))}


def collect(*, env: dict[str, str] | None = None, offers: dict[str, dict] | None = None,
            gpu_pcis: list[str] | None = None, sysfs: str = "/sys", peer_access=None,
            allowed_cpus: set[int] | None = None) -> dict[str, Any]:
    """The whole report. Every input can be given (tests feed fixtures of other machines)."""
    env = dict(os.environ) if env is None else env
    offers = providers() if offers is None else offers
    if gpu_pcis is None:
        gpu_pcis = topology.gpu_pci_addresses()
    if peer_access is None:
        peer_access = _peer_access
    chosen = default_provider(offers, env)
    offer = offers.get(chosen) if chosen else None
    if offer is not None and "error" in offer:
        offer = None
    return {
        "libfabric": "%d.%d" % _C.libfabric_version(),
        "cuda_build": _C.with_cuda,
        "providers": offers,
        "default_provider": chosen,
        "gpus": gpu_plans(offer, gpu_pcis, sysfs, allowed_cpus),
        "ptrace_scope": (scope := ptrace_scope()),
        "routes": routes(len(gpu_pcis), peer_access, offer, env, scope),
        "ptrace": ptrace_consent(scope, env),
        "settings": settings(env),
        "host_plan": host_plan(chosen, offer),
        "failed_calls": failed_calls(chosen, env),
    }


def _peer_access(i: int, j: int) -> bool:
    import torch

    return torch.cuda.can_device_access_peer(i, j)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def diagnose(report: dict[str, Any]) -> list[dict[str, str]]:
    """What will make transfers slow or fail, each with its fix."""
    found: list[dict[str, str]] = []

    def warn(problem: str, fix: str) -> None:
        found.append({"problem": problem, "fix": fix})

    version = _version(report["libfabric"])
    chosen = report["default_provider"]
    offer = report["providers"].get(chosen, {}) if chosen else {}
    gpus = report["gpus"]
    env = report["settings"]
    if chosen is None:
        warn("no libfabric provider with RDM endpoints and RMA was found",
             "install libfabric (Debian/Ubuntu: apt-get install libfabric-dev) or set LIBFABRIC_HOME")
        return found
    if chosen == "efa":
        if not offer.get("hmem") and gpus:
            warn("efa offers no FI_HMEM: GPU memory is staged through host memory (no GPUDirect RDMA)",
                 "build against the EFA installer's libfabric (>= 1.18): LIBFABRIC_HOME=/opt/amazon/efa, "
                 "and set FI_EFA_USE_DEVICE_RDMA=1")
        if version < (1, 18) and env.get("FI_EFA_USE_DEVICE_RDMA") != "1":
            warn(f"libfabric {report['libfabric']} emulates every EFA RMA write and turns device RDMA off",
                 "use libfabric >= 1.18 (the EFA installer's), or set FI_EFA_USE_DEVICE_RDMA=1")
    profile = _C.provider_profile(chosen)
    if profile["rdma"] and gpus and offer.get("hmem") and version < (1, 20):
        warn(f"libfabric {report['libfabric']} has no dma-buf registration: GPU memory needs nvidia-peermem",
             "use libfabric >= 1.20 (FI_MR_DMABUF), or load nvidia-peermem")
    if profile["remote"] and not profile["rdma"] and gpus:
        warn(f"no RDMA provider (efa, verbs): GPU memory to other hosts is staged through host memory over {chosen}",
             "install the NIC's libfabric (EFA installer, rdma-core with verbs) and point LIBFABRIC_HOME at it")
    if not profile["remote"]:
        problem = f", and {profile['known_problem']}" if profile["known_problem"] else ""
        warn(f"{chosen} is chosen: it reaches this host only{problem}",
             "leave TORCH_P2P_PROVIDER unset (same-host GPU memory takes the CUDA IPC route on any provider)")
    for g in gpus:
        if "error" in g:
            warn(f"{g['device']}: no plan ({g['error']})", "check TORCH_P2P_DOMAINS / TORCH_P2P_NUM_RAILS")
            continue
        if profile["rdma"] and not g["own_nic"]:
            warn(f"{g['device']} has no NIC of its own ({g['reason']}): it shares bandwidth with another GPU",
                 "run fewer engines per NIC, or check the PCIe topology (nvidia-smi topo -m)")
        used = len(set(g["rails"]))
        if used < g["nics_near"]:
            warn(f"{g['device']} has {used} rail(s) on {g['nics_near']} NICs: {g['nics_near'] - used} stay idle",
                 "unset TORCH_P2P_NUM_RAILS (and TORCH_P2P_DOMAINS): every NIC of the GPU becomes a rail")
    if env.get("TORCH_P2P_CMA", "1") != "0" and (scope := report.get("ptrace_scope", 0)) >= 2:
        warn(f"kernel.yama.ptrace_scope is {scope}: the cma route is off, host memory between processes "
             "of this host takes the fabric", "sysctl kernel.yama.ptrace_scope=1 (an engine's process then "
             "consents to one peer's copies of its private memory with PR_SET_PTRACER)")
    if env.get("TORCH_P2P_CMA_PTRACE") == "any" and report.get("ptrace_scope", 0) == 1:
        warn("TORCH_P2P_CMA_PTRACE=any: every process of this user may read and write the memory of a "
             "process that opens an engine, as if kernel.yama.ptrace_scope were 0",
             "unset it (each process then consents to one peer); tensors in shared memory "
             "(share_memory_() before register) reach every peer without consent")
    if env.get("FI_AV_REMOVE_CLEANUP", "1") in ("0", "false", "no"):
        warn("FI_AV_REMOVE_CLEANUP is off: a dead peer's connections are not cut, so a failed call's "
             "operations may still move bytes until the provider gives them up",
             "unset it (the engine sets FI_AV_REMOVE_CLEANUP=1 when it loads)")
    if env.get("TORCH_P2P_SHM_FAST") == "1":
        warn("TORCH_P2P_SHM_FAST=1: shm RMA checks no key, access or bounds",
             "unset it unless every local process of this user is trusted")
    return found


def render(report: dict[str, Any], warnings: list[dict[str, str]]) -> str:
    lines = [f"libfabric {report['libfabric']}, torch_p2p built {'with' if report['cuda_build'] else 'without'} CUDA",
             "", "providers:"]
    for name, o in report["providers"].items():
        if "error" in o:
            lines.append(f"  {name:6} not available ({o['error']})")
            continue
        domains = ", ".join(dict.fromkeys(n["domain"] for n in o["nics"]))
        lines.append(
            f"  {name:6} {o['provider']} ({len(o['nics'])} NIC{'s' * (len(o['nics']) != 1)}: {domains}): "
            f"FI_HMEM {'yes' if o['hmem'] else 'no'}, dma-buf {'yes' if o['dmabuf'] else 'no'}, "
            f"delivery-complete {'yes' if o['delivery_complete'] else 'no'}, "
            f"progress {'provider threads' if o['auto_progress'] else 'engine thread'}")
        if report["cuda_build"]:  # a build without CUDA takes no GPU memory at all
            lines.append("         GPU memory registers: " + "; ".join(
                f"{kind} {how}" for kind, (how, _) in gpu_registration(name, o).items()))
        lines.append(
            f"         iov {o['iov_limit']}, rma iov {o['rma_iov_limit']}, max msg {_size(o['max_msg_size'])}, "
            f"inject {o['inject_size']}, cq data {o['cq_data_size']} B, key {o['mr_key_size']} B, "
            f"mr_mode {'|'.join(o['mr_mode']) or '0'}")
    lines += ["", f"default provider: {report['default_provider'] or 'none'}"]
    if report["host_plan"]:
        lines.append(f"host engines on {report['default_provider']}: {report['host_plan']}")
    if report["gpus"]:
        lines.append("GPUs:")
        for g in report["gpus"]:
            lines.append(f"  {g['device']}: {g.get('reason') or g.get('error')}")
    else:
        lines.append("GPUs: none visible")
    lines.append("routes:")
    for r in report["routes"]:
        lines.append(f"  {r['from']} -> {r['to']}: {r['route']}")
    lines.append(f"ptrace: {report['ptrace']}")
    if report.get("failed_calls"):
        lines.append(f"a failed call ({report['default_provider']}): {report['failed_calls']}")
    lines.append("settings: " + (", ".join(f"{k}={v}" for k, v in report["settings"].items()) or "none set"))
    if "check" in report:
        lines.append("check (loopback, this process; baseline: memcpy of the same bytes, same run):")
        for c in report["check"]:
            if "error" in c:
                lines.append(f"  {c['what']}: FAILED: {c['error']}")
            else:
                lines.append(f"  {c['what']}: route {c['route']}, {c['gbps']:.1f} GB/s, "
                             f"memcpy {c['baseline_gbps']:.1f} GB/s ({c['gbps'] / c['baseline_gbps']:.2f} x)")
    lines.append("")
    if warnings:
        lines.append(f"{len(warnings)} warning(s):")
        for w in warnings:
            lines += [f"  ! {w['problem']}", f"    fix: {w['fix']}"]
    else:
        lines.append("no warnings")
    return "\n".join(lines)


def _size(n: int) -> str:
    return "unlimited" if n >= 1 << 62 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} B"


def _rate(fn: Callable[[], None], nbytes: int, seconds: float = 0.3) -> float:
    fn()  # warm: connections, mappings, first-touch
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return n * nbytes / (time.perf_counter() - start) / 1e9


def check(report: dict[str, Any], nbytes: int = 16 << 20) -> list[dict[str, Any]]:
    """Moves `nbytes` between two engines of this process on each device this host has: the
    route they take, GB/s, and a memcpy of the same bytes on the same device."""
    import torch

    from .engine import Engine

    devices = ["cpu"] + [g["device"] for g in report["gpus"]]
    rows = []
    for device in devices:
        row: dict[str, Any] = {"what": f"{device} -> {device}, {nbytes >> 20} MiB write"}
        try:
            with Engine(device) as a, Engine(device) as b:
                src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
                dst = torch.zeros_like(src)
                a.register(src)
                remote = b.register(dst).remote
                row["route"] = a.route(remote)

                def move():
                    a.write_slices([src], [remote]).wait()

                row["gbps"] = _rate(move, nbytes)
                if not torch.equal(src, dst):
                    raise RuntimeError("the bytes that arrived differ from the source")
                copy_dst = torch.empty_like(src)

                def copy():
                    copy_dst.copy_(src)
                    if src.is_cuda:
                        torch.cuda.synchronize(src.device)

                row["baseline_gbps"] = _rate(copy, nbytes)
        except Exception as e:  # noqa: BLE001 - a route that fails is what doctor reports
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torch-p2p-doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="move data over each route, beside a memcpy baseline")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = collect()
    if args.check:
        report["check"] = check(report)
    warnings = diagnose(report)
    report["warnings"] = warnings
    print(json.dumps(report, indent=2, default=str) if args.json else render(report, warnings))
    failed = any("error" in c for c in report.get("check", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
