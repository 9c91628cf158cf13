"""Rail and CPU choice against fake sysfs trees (no GPU, no libfabric)."""

import os
import types

import pytest

from torch_p2p import topology
from torch_p2p.topology import Nic, gpu_pci_addresses, line_rate_bps, parse_cpulist, plan
from topologies import FakeSysfs, aws_host, efa, p4d

pytestmark = pytest.mark.usefixtures("clean_env")


def test_p5_each_gpu_gets_its_four_nics_and_a_local_core(tmp_path):
    fs, gpu_pcis, nics, nics_of = aws_host(tmp_path, gpus=8, nics_per_gpu=4)
    assert len(nics) == 32
    kw = dict(gpu_pcis=gpu_pcis, sysfs=fs.root, allowed_cpus=set(range(96)))
    # libfabric's order need not follow the PCIe tree.
    p = plan(list(reversed(nics)), "cuda:3", **kw)
    assert sorted(p.rails, key=lambda n: n.pci) == nics_of[3]
    assert p.numa == 0 and 1 <= p.cpu < 48
    assert "cuda:3 -> 4 rails" in p.reason and gpu_pcis[3] in p.reason
    assert line_rate_bps(p.rails) == 400_000_000_000

    node0 = [plan(nics, f"cuda:{g}", **kw).cpu for g in range(4)]
    assert len(set(node0)) == 4 and all(1 <= c < 48 for c in node0)
    p5 = plan(nics, "cuda:5", **kw)
    assert p5.numa == 1 and 48 <= p5.cpu < 96
    assert set(p5.rails) == set(nics_of[5])


def test_p5en_two_nics_per_gpu(tmp_path):
    fs, gpu_pcis, nics, nics_of = aws_host(tmp_path, gpus=8, nics_per_gpu=2)
    assert len(nics) == 16
    for g in range(8):
        p = plan(nics, f"cuda:{g}", gpu_pcis=gpu_pcis, sysfs=fs.root, allowed_cpus=set(range(96)))
        assert set(p.rails) == set(nics_of[g]) and len(p.rails) == 2


def test_two_gpus_under_one_switch_split_the_nics(tmp_path):
    fs = FakeSysfs(tmp_path)
    gpu0, gpu1, *nic_pcis = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 6, 0)
    nics = [efa(b) for b in nic_pcis]
    plans = [plan(nics, f"cuda:{g}", gpu_pcis=[gpu0, gpu1], sysfs=fs.root) for g in range(2)]
    assert plans[0].rails == nics[:2] and plans[1].rails == nics[2:]
    assert "split with cuda:1" in plans[0].reason


def test_fewer_nics_than_gpus_share_round_robin(tmp_path):
    fs = FakeSysfs(tmp_path)
    *gpus, n0, n1 = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 6, 0)
    nics = [efa(n0), efa(n1)]
    got = [plan(nics, f"cuda:{g}", gpu_pcis=gpus, sysfs=fs.root).rails for g in range(4)]
    assert got == [[nics[0]], [nics[1]], [nics[0]], [nics[1]]]


def test_gpu_without_own_nic_uses_nearest(tmp_path):
    fs = FakeSysfs(tmp_path)
    gpu0, nic = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 2, 0)
    (gpu1,) = fs.switch("pci0000:00", "0000:00:02.0", 0x20, 1, 0)
    p = plan([efa(nic)], "cuda:1", gpu_pcis=[gpu0, gpu1], sysfs=fs.root)
    assert p.rails == [efa(nic)] and "owns no NIC" in p.reason


def test_flat_pcie_tree_falls_back_to_numa(tmp_path):
    # Some VMs hang every device straight off one root complex; NUMA is the only hint.
    fs = FakeSysfs(tmp_path)
    gpus = [fs.device(["pci0000:00", f"0000:00:0{i}.0"], numa=i - 1) for i in (1, 2)]
    nics = [efa(fs.device(["pci0000:00", f"0000:00:0{i}.0"], numa=i - 3)) for i in (3, 4)]
    fs.node(0, "0-7")
    fs.node(1, "8-15")
    for g in range(2):
        p = plan(nics, f"cuda:{g}", gpu_pcis=gpus, sysfs=fs.root, allowed_cpus=set(range(16)))
        assert p.rails == [nics[g]] and p.numa == g


def test_nics_without_pci_use_all_and_cpu_stays_local(tmp_path):
    fs = FakeSysfs(tmp_path)
    (gpu,) = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 1, 0)
    fs.node(0, "0-3")
    nics = [Nic("eth0"), Nic("eth1")]
    p = plan(nics, "cuda:0", gpu_pcis=[gpu], sysfs=fs.root, allowed_cpus={0, 1, 2, 3})
    assert p.rails == nics and p.cpu == 1 and p.numa == 0
    assert "unknown" in p.reason


def test_nic_located_through_class_net(tmp_path):
    fs = FakeSysfs(tmp_path)
    gpu0, eth1_pci = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 2, 0)
    gpu1, eth0_pci = fs.switch("pci0000:00", "0000:00:02.0", 0x20, 2, 0)
    for name, bdf in (("eth0", eth0_pci), ("eth1", eth1_pci)):
        os.makedirs(f"{fs.root}/class/net/{name}")
        os.symlink(os.path.realpath(f"{fs.root}/bus/pci/devices/{bdf}"),
                   f"{fs.root}/class/net/{name}/device")
    nics = [Nic("eth0"), Nic("eth1")]
    p = plan(nics, "cuda:0", gpu_pcis=[gpu0, gpu1], sysfs=fs.root)
    assert p.rails == [Nic("eth1")]


def test_no_gpu_info_uses_all_nics(tmp_path):
    p = plan([Nic("eth0"), Nic("eth1")], "cuda:0", gpu_pcis=[], sysfs=str(tmp_path),
             allowed_cpus={0, 1, 2, 3})
    assert [n.domain for n in p.rails] == ["eth0", "eth1"] and p.cpu == 1 and p.numa is None


def test_cpu_spread_skips_smt_siblings_and_cpu0(tmp_path):
    fs = FakeSysfs(tmp_path)
    (gpu0,) = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 1, 0)
    (gpu1,) = fs.switch("pci0000:00", "0000:00:02.0", 0x20, 1, 0)
    fs.node(0, "0-3,8-11")
    for c in range(4):
        fs.siblings(c, f"{c},{c + 8}")
        fs.siblings(c + 8, f"{c},{c + 8}")
    kw = dict(gpu_pcis=[gpu0, gpu1], sysfs=fs.root, allowed_cpus=set(range(16)))
    assert [plan([Nic("eth0")], f"cuda:{g}", **kw).cpu for g in range(2)] == [1, 2]


def _claims(tmp_path):
    """claim_core in a scope of this test's own, so that live engines on the host do not count."""
    scope = f"torch_p2p-test/{os.getpid()}/{tmp_path.name}"
    return lambda cpu: topology.claim_core(cpu, scope)


def test_engines_of_one_gpu_claim_different_cores(tmp_path):
    # Two processes (or two engines) on one GPU would otherwise pin both busy-polling workers to
    # the share's first core, each getting half of it.
    fs = FakeSysfs(tmp_path)
    (gpu0,) = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 1, 0)
    (gpu1,) = fs.switch("pci0000:00", "0000:00:02.0", 0x20, 1, 0)
    fs.node(0, "0-7")
    kw = dict(gpu_pcis=[gpu0, gpu1], sysfs=fs.root, allowed_cpus=set(range(8)), claim=_claims(tmp_path))
    first = [plan([Nic("eth0")], "cuda:0", **kw) for _ in range(3)]
    assert [p.cpu for p in first] == [1, 2, 3]  # GPU 0's share of cores 1-7 is 1-3
    assert all(p.claim is not None and "shared" not in p.reason for p in first)
    gpu1_plans = [plan([Nic("eth0")], "cuda:1", **kw) for _ in range(2)]
    assert [p.cpu for p in gpu1_plans] == [4, 5]  # its own share, from its first core
    # A full share takes the node's next free core; a released core is taken again.
    spill = plan([Nic("eth0")], "cuda:0", **kw)
    assert spill.cpu == 6
    first[1].release()
    first[1].release()  # idempotent
    again = plan([Nic("eth0")], "cuda:0", **kw)
    assert again.cpu == 2
    for p in first + gpu1_plans + [spill, again]:
        p.release()
    # Without claims (what plan() does when not told) the choice is the share's first core.
    assert plan([Nic("eth0")], "cuda:0", gpu_pcis=[gpu0, gpu1], sysfs=fs.root, allowed_cpus=set(range(8))).cpu == 1


def test_every_core_claimed_shares_and_says_so(tmp_path):
    fs = FakeSysfs(tmp_path)
    (gpu,) = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 1, 0)
    fs.node(0, "0-1")
    kw = dict(gpu_pcis=[gpu], sysfs=fs.root, allowed_cpus={0, 1}, claim=_claims(tmp_path))
    a = plan([Nic("eth0")], "cuda:0", **kw)
    b = plan([Nic("eth0")], "cuda:0", **kw)
    assert a.cpu == b.cpu == 1 and a.claim is not None and b.claim is None
    assert "shared" in b.reason and "shared" not in a.reason
    a.release()


def test_cores_unclaimable_pin_the_first_and_say_so(tmp_path):
    def refused(cpu):
        raise OSError("no Unix sockets here")

    p = plan([Nic("eth0")], "cuda:0", gpu_pcis=[], sysfs=str(tmp_path), allowed_cpus={0, 1, 2, 3}, claim=refused)
    assert p.cpu == 1 and p.claim is None and "not claimed: no Unix sockets here" in p.reason


def test_a_dead_process_leaves_its_core_free(tmp_path):
    import subprocess
    import sys

    scope = f"torch_p2p-test/{os.getpid()}/{tmp_path.name}"
    code = ("import sys, time; from torch_p2p import topology; "
            f"c = topology.claim_core(5, {scope!r}); print(c is not None, flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        assert topology.claim_core(5, scope) is None
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    claim = topology.claim_core(5, scope)
    assert claim is not None
    claim.close()


def test_numa_unknown_spreads_over_allowed_cpus(tmp_path):
    fs = FakeSysfs(tmp_path)
    gpus = [fs.device(["pci0000:00", f"0000:00:0{i}.0"], numa=-1) for i in (1, 2)]
    kw = dict(gpu_pcis=gpus, sysfs=fs.root, allowed_cpus={0, 4, 5, 6, 7})
    assert [plan([Nic("eth0")], f"cuda:{g}", **kw).cpu for g in range(2)] == [4, 6]
    assert plan([Nic("eth0")], "cuda:0", **kw).numa is None


def test_cpu_device_uses_all_nics_and_does_not_pin():
    nics = [Nic("eth0"), Nic("ib0"), Nic("lo")]
    p = plan(nics, "cpu")
    assert [n.domain for n in p.rails] == ["eth0", "ib0"]
    assert p.cpu is None and p.numa is None and "no cpu pinning" in p.reason


def test_loopback_alone_cycles_to_num_rails():
    p = plan([Nic("lo")], "cpu", 8)
    assert p.rails == [Nic("lo")] * 8 and "8 rails [lo]" in p.reason
    p = plan([Nic("lo")], "cuda:0", 8, gpu_pcis=[])
    assert p.rails == [Nic("lo")] * 8


def test_num_rails_cycles_and_truncates():
    nics = [Nic("a"), Nic("b"), Nic("c")]
    assert [n.domain for n in plan(nics, "cpu", 5).rails] == ["a", "b", "c", "a", "b"]
    assert [n.domain for n in plan(nics, "cpu", 2).rails] == ["a", "b"]


def test_loopback_rules_and_duplicates():
    assert plan([Nic("lo"), Nic("eth0")], "cpu").rails == [Nic("eth0")]
    assert plan([Nic("lo"), Nic("eth0")], "cpu", domains=["lo"]).rails == [Nic("lo")]
    p = plan([Nic("lo"), Nic("eth0")], "cpu", domains=["eth0", "lo", "eth0"])
    assert [n.domain for n in p.rails] == ["eth0", "lo"]
    p = plan([Nic("eth0", speed_bps=1), Nic("eth0", speed_bps=2), Nic("lo")], "cpu")
    assert p.rails == [Nic("eth0", speed_bps=1)]


def test_env_overrides(monkeypatch):
    nics = [Nic("lo"), Nic("eth0"), Nic("eth1")]
    monkeypatch.setenv("TORCH_P2P_DOMAINS", " eth1 , lo ")
    monkeypatch.setenv("TORCH_P2P_NUM_RAILS", "3")
    monkeypatch.setenv("TORCH_P2P_CPUS", "5,7-8")
    p = plan(nics, "cpu")
    assert [n.domain for n in p.rails] == ["eth1", "lo", "eth1"]
    assert p.cpu == 5 and "TORCH_P2P_CPUS" in p.reason
    assert plan(nics, "cuda:4", gpu_pcis=[]).cpu == 7  # ordinal 4 of a 3-entry list
    # Arguments win over the environment.
    p = plan(nics, "cpu", 1, domains=["eth0"], cpus=[2])
    assert p.rails == [Nic("eth0")] and p.cpu == 2
    monkeypatch.setenv("TORCH_P2P_DOMAINS", "")  # blank means unset
    assert [n.domain for n in plan(nics, "cpu").rails] == ["eth0", "eth1", "eth0"]


@pytest.mark.parametrize("var,value", [
    ("TORCH_P2P_NUM_RAILS", "two"),
    ("TORCH_P2P_NUM_RAILS", "0"),
    ("TORCH_P2P_CPUS", "3-1"),
    ("TORCH_P2P_CPUS", "x"),
    ("TORCH_P2P_DOMAINS", "nope"),
    ("TORCH_P2P_DOMAINS", ",,"),
])
def test_bad_env_values_name_variable_and_value(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var) as err:
        plan([Nic("eth0")], "cpu")
    assert value.strip(",") in str(err.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"unknown domain.*'eth9'.*available: \['eth0', 'lo'\]"):
        plan([Nic("eth0"), Nic("lo")], "cpu", domains=["eth9"])
    with pytest.raises(ValueError, match="num_rails must be >= 1"):
        plan([Nic("eth0")], "cpu", 0)
    with pytest.raises(ValueError, match="device"):
        plan([Nic("eth0")], "gpu:0")
    with pytest.raises(ValueError, match="no NICs"):
        plan([], "cpu")
    with pytest.raises(ValueError, match="cpus"):
        plan([Nic("eth0")], "cpu", cpus=[])


@pytest.mark.parametrize("text,expected", [
    ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
    ("", []),
    ("\n", []),
    ("5\n", [5]),
    ("0-0", [0]),
    (" 1 , 3-4 ", [1, 3, 4]),
    ("9,2", [9, 2]),
])
def test_parse_cpulist(text, expected):
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["3-1", "a", "-1", "1-", "1-2-3", "0-7:2"])
def test_parse_cpulist_rejects(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


def test_line_rate_bps():
    a, b = Nic("a", speed_bps=100), Nic("b", speed_bps=200)
    assert line_rate_bps([a, b]) == 300
    assert line_rate_bps([a, b, a, b]) == 300  # extra domains on one NIC add no wire
    assert line_rate_bps([a, Nic("c")]) is None
    assert line_rate_bps([a, Nic("c", speed_bps=0)]) is None
    assert line_rate_bps([]) is None


def test_gpu_pci_addresses_without_cuda():
    assert gpu_pci_addresses() == []


def test_gpu_pci_addresses_formats_torch_properties(monkeypatch):
    import torch

    props = [types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x53, pci_device_id=0),
             types.SimpleNamespace(pci_domain_id=1, pci_bus_id=0xA8, pci_device_id=0x1B)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert gpu_pci_addresses() == ["0000:53:00.0", "0001:a8:1b.0"]
    props[1] = types.SimpleNamespace()  # an old torch without PCI attributes
    assert gpu_pci_addresses() == []


def test_module_has_no_torch_import_at_top_level():
    # The engine must be able to plan before torch initialises CUDA.
    assert "torch" not in vars(topology)


def test_p4d_two_gpus_share_their_switch_nic(tmp_path):
    fs, gpu_pcis, nics, nics_of = p4d(tmp_path)
    assert len(gpu_pcis) == 8 and len(nics) == 4
    for g in range(8):
        p = plan(nics, f"cuda:{g}", gpu_pcis=gpu_pcis, sysfs=fs.root, allowed_cpus=set(range(48)))
        assert p.rails == nics_of[g], g
        assert p.numa == g // 4 and p.cpu in range(24 * (g // 4), 24 * (g // 4 + 1)) and p.cpu != 0
