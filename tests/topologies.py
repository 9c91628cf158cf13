"""Fake sysfs trees of real hosts, for topology and doctor tests (no GPU, no libfabric)."""

import os

from torch_p2p.topology import Nic


class FakeSysfs:
    """A /sys with real device directories and bus/pci/devices symlinks into them."""

    def __init__(self, root):
        self.root = str(root)
        os.makedirs(f"{self.root}/bus/pci/devices")

    def device(self, chain, numa):
        """chain: root complex then BDFs down to the device; every PCI dir gets numa_node."""
        path = f"{self.root}/devices"
        for part in chain:
            path = f"{path}/{part}"
            os.makedirs(path, exist_ok=True)
            if not part.startswith("pci"):
                with open(f"{path}/numa_node", "w") as f:
                    f.write(f"{numa}\n")
                link = f"{self.root}/bus/pci/devices/{part}"
                if not os.path.islink(link):
                    os.symlink(os.path.relpath(path, os.path.dirname(link)), link)
        return chain[-1]

    def switch(self, root, port, bus, endpoints, numa):
        """A PCIe switch below root port `port`; returns its endpoints' BDFs."""
        upstream = f"0000:{bus:02x}:00.0"
        return [
            self.device([root, port, upstream, f"0000:{bus + 1:02x}:{i:02x}.0",
                         f"0000:{bus + 2 + i:02x}:00.0"], numa)
            for i in range(endpoints)
        ]

    def node(self, k, cpulist):
        os.makedirs(f"{self.root}/devices/system/node/node{k}", exist_ok=True)
        with open(f"{self.root}/devices/system/node/node{k}/cpulist", "w") as f:
            f.write(cpulist + "\n")

    def siblings(self, cpu, cpulist):
        d = f"{self.root}/devices/system/cpu/cpu{cpu}/topology"
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/thread_siblings_list", "w") as f:
            f.write(cpulist + "\n")


def efa(bdf):
    bus, dev = int(bdf[5:7], 16), int(bdf[8:10], 16)
    return Nic(f"rdmap{bus}s{dev}", pci=bdf, speed_bps=100_000_000_000)


def aws_host(tmp_path, gpus, nics_per_gpu, cores_per_node=48):
    """p5-like: each GPU with its NICs under its own switch; first half of GPUs on NUMA 0.
    Returns (sysfs, GPU BDFs by ordinal, every NIC, each GPU's NICs)."""
    fs = FakeSysfs(tmp_path)
    gpu_pcis, nics, nics_of = [], [], []
    for g in range(gpus):
        numa = g * 2 // gpus
        root = f"pci0000:{numa * 0x80:02x}"
        port = f"0000:{numa * 0x80:02x}:{g + 1:02x}.0"
        gpu, *mine = fs.switch(root, port, numa * 0x80 + 0x10 * (g % (gpus // 2)) + 1,
                               1 + nics_per_gpu, numa)
        gpu_pcis.append(gpu)
        nics_of.append([efa(b) for b in mine])
        nics += nics_of[-1]
    for k in range(2):
        fs.node(k, f"{k * cores_per_node}-{(k + 1) * cores_per_node - 1}")
    return fs, gpu_pcis, nics, nics_of


# AWS instance layouts, from AWS's published topology (the EFA and P5 user guides, and
# `nvidia-smi topo -m` / `lstopo` output that users of these instances publish):
# - p5.48xlarge: 8 H100, 32 EFA NICs of 100 Gbps, 4 under each GPU's PCIe switch; GPUs 0-3 on
#   NUMA node 0, 4-7 on node 1; 2 x 48 cores.
# - p5en.48xlarge: 8 H200, 16 EFA NICs of 200 Gbps, 2 under each GPU's switch; 2 NUMA nodes.
# - p4d.24xlarge: 8 A100, 4 EFA NICs of 100 Gbps, one under each PCIe switch that holds two
#   GPUs; GPUs 0-3 on node 0, 4-7 on node 1; 2 x 24 cores.
def p5(tmp_path):
    return aws_host(tmp_path, gpus=8, nics_per_gpu=4)


def p5en(tmp_path):
    fs, gpu_pcis, nics, nics_of = aws_host(tmp_path, gpus=8, nics_per_gpu=2)
    fast = {n.domain: Nic(n.domain, n.pci, 200_000_000_000) for n in nics}
    return fs, gpu_pcis, [fast[n.domain] for n in nics], [[fast[n.domain] for n in g] for g in nics_of]


def p4d(tmp_path):
    """Returns (sysfs, GPU BDFs by ordinal, every NIC, each GPU's NICs: its switch's one NIC)."""
    fs = FakeSysfs(tmp_path)
    gpu_pcis, nics, nics_of = [], [], []
    for s in range(4):
        numa = s // 2
        root = f"pci0000:{numa * 0x80:02x}"
        port = f"0000:{numa * 0x80:02x}:{s + 1:02x}.0"
        g0, g1, nic = fs.switch(root, port, numa * 0x80 + 0x10 * (s % 2) + 1, 3, numa)
        gpu_pcis += [g0, g1]
        nics.append(efa(nic))
        nics_of += [[nics[-1]], [nics[-1]]]
    for k in range(2):
        fs.node(k, f"{k * 24}-{(k + 1) * 24 - 1}")
    return fs, gpu_pcis, nics, nics_of
