"""python -m torch_p2p.doctor: on this machine, on fixtures of AWS hosts, and each warning."""
import json
import os
import subprocess
import sys

import pytest

from checkout import ROOT, checkout_env
import torch_p2p as p2p
from torch_p2p import doctor
from topologies import FakeSysfs, efa, p4d, p5, p5en


pytestmark = pytest.mark.usefixtures("clean_env")


def offer(provider, nics, hmem=True):
    return {"provider": provider, "fabric": provider, "hmem": hmem, "delivery_complete": True,
            "auto_progress": False, "mr_mode": ["FI_MR_LOCAL", "FI_MR_PROV_KEY"], "iov_limit": 1,
            "rma_iov_limit": 1, "inject_size": 32, "max_msg_size": 1 << 30, "cq_data_size": 4,
            "mr_key_size": 4, "dmabuf": hmem,
            "nics": [{"domain": n.domain, "pci": n.pci, "speed_bps": n.speed_bps} for n in nics]}


ABSENT = {"error": "not available"}


def aws_report(host, *, hmem=True, version="1.22", env=None, provider="efa"):
    fs, gpu_pcis, nics, nics_of = host
    offers = {"efa": ABSENT, "verbs": ABSENT, "tcp": ABSENT, "shm": ABSENT}
    offers[provider] = offer(provider, nics, hmem)
    report = doctor.collect(env=env or {}, offers=offers, gpu_pcis=gpu_pcis, sysfs=fs.root,
                            peer_access=lambda i, j: True, allowed_cpus=set(range(96)))
    report["libfabric"] = version
    report["cuda_build"] = True  # the fixtures are GPU hosts, with a build that has CUDA
    return report, nics_of


def problems(report):
    return [w["problem"] for w in doctor.diagnose(report)]


def test_runs_here_and_prints_json():
    out = subprocess.run([sys.executable, "-m", "torch_p2p.doctor", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=checkout_env())
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    tcp = report["providers"]["tcp"]
    assert tcp["provider"].startswith("tcp") and tcp["nics"]
    for key in ("mr_mode", "iov_limit", "rma_iov_limit", "max_msg_size", "inject_size", "cq_data_size", "hmem", "dmabuf"):
        assert key in tcp
    assert "error" in report["providers"]["efa"]
    assert report["default_provider"] in ("tcp", os.environ.get("TORCH_P2P_PROVIDER"))
    assert {"from": "cpu", "to": "cpu", "route": "cma"} in report["routes"]
    assert {"from": "cpu", "to": "another host", "route": f"{tcp['provider']}, direct"} in report["routes"]


def test_text_names_the_nics_and_the_rails_a_host_engine_opens(monkeypatch):
    """The text a newcomer reads: each provider's NICs by name, the rails a host engine opens
    on the default provider (loopback is left out beside a real NIC, and says so), and GPU
    memory registration only in a build with CUDA."""
    nics = [{"domain": "eth0", "pci": None, "speed_bps": None}, {"domain": "lo", "pci": None, "speed_bps": None}]
    monkeypatch.setattr(doctor.topology, "default_tcp_rails", lambda: 1)  # as on a host of under 8 cores
    offers = {p: ABSENT for p in doctor.PROVIDERS}
    offers["tcp"] = {**offer("tcp;ofi_rxm", []), "hmem": False, "dmabuf": False, "nics": nics}
    report = doctor.collect(env={}, offers=offers, gpu_pcis=[])
    for cuda in (False, True):
        text = doctor.render({**report, "cuda_build": cuda}, [])
        assert "tcp;ofi_rxm (2 NICs: eth0, lo)" in text
        assert "host engines on tcp: cpu -> 1 rail [eth0] (all NICs but lo, which never leaves the host)" in text
        assert ("GPU memory registers: cuda staged; vmm staged" in text) == cuda


@pytest.mark.parametrize("provider, cma, route", [("tcp", "1", "cma"), ("shm", "1", "cma"), ("tcp", "0", "direct"),
                                                  ("shm", "0", "direct")])
def test_check_moves_data_beside_a_memcpy(monkeypatch, provider, cma, route):
    monkeypatch.setenv("TORCH_P2P_PROVIDER", provider)
    monkeypatch.setenv("TORCH_P2P_CMA", cma)
    report = doctor.collect(gpu_pcis=[])
    said = report["routes"][0]["route"]  # cpu -> cpu on this host
    assert said == "cma" if route == "cma" else said.endswith(", direct"), said
    (row,) = doctor.check(report, nbytes=1 << 20)
    assert "error" not in row, row
    assert row["route"] == route and row["gbps"] > 0 and row["baseline_gbps"] > 0
    assert "memcpy" in doctor.render({**report, "check": [row]}, [])


def test_p5_plan_each_gpu_its_four_nics_and_no_warning(tmp_path):
    report, nics_of = aws_report(p5(tmp_path), env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    for g, row in enumerate(report["gpus"]):
        assert sorted(row["rails"]) == sorted(n.domain for n in nics_of[g])
        assert row["numa"] == g // 4 and row["own_nic"] and row["line_rate_bps"] == 400e9
    text = doctor.render(report, doctor.diagnose(report))
    assert "cuda:3 -> 4 rails" in text and "cuda:7 -> 4 rails" in text
    assert {"from": "cuda:0", "to": "cuda:1", "route": "ipc"} in report["routes"]
    assert {"from": "cuda:0", "to": "another host", "route": "efa, direct"} in report["routes"]
    assert problems(report) == []


def test_p5en_and_p4d_plans(tmp_path):
    report, nics_of = aws_report(p5en(tmp_path / "p5en"))
    assert all(len(g["rails"]) == 2 and g["line_rate_bps"] == 400e9 for g in report["gpus"])
    report, nics_of = aws_report(p4d(tmp_path / "p4d"))
    assert [g["rails"] for g in report["gpus"]] == [[n.domain for n in nics] for nics in nics_of]


def test_warns_efa_without_hmem(tmp_path):
    report, _ = aws_report(p5(tmp_path), hmem=False)
    (problem,) = [p for p in problems(report) if "FI_HMEM" in p]
    assert "staged" in problem


def test_warns_old_libfabric_on_efa(tmp_path):
    report, _ = aws_report(p5(tmp_path), version="1.17")
    assert any("emulates every EFA RMA write" in p for p in problems(report))
    report, _ = aws_report(p5(tmp_path / "b"), version="1.17", env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    assert not any("emulates" in p for p in problems(report))


def test_warns_no_dmabuf_below_1_20(tmp_path):
    report, _ = aws_report(p5(tmp_path), version="1.19")
    assert any("dma-buf" in p for p in problems(report))


def test_warns_tcp_with_gpus(tmp_path):
    report, _ = aws_report(p5(tmp_path), provider="tcp", hmem=False)
    assert any("no RDMA provider" in p for p in problems(report))
    assert {"from": "cuda:0", "to": "another host", "route": "tcp, staged"} in report["routes"]


def test_warns_gpu_without_its_own_nic(tmp_path):
    fs = FakeSysfs(tmp_path)
    gpu0, nic = fs.switch("pci0000:00", "0000:00:01.0", 0x10, 2, 0)
    (gpu1,) = fs.switch("pci0000:00", "0000:00:02.0", 0x20, 1, 0)
    fs.node(0, "0-7")
    report, _ = aws_report((fs, [gpu0, gpu1], [efa(nic)], None), env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    assert [p for p in problems(report) if "no NIC of its own" in p] and "cuda:1" in problems(report)[0]


def test_warns_rails_fewer_than_nics(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_P2P_NUM_RAILS", "2")
    report, _ = aws_report(p5(tmp_path), env={"FI_EFA_USE_DEVICE_RDMA": "1", "TORCH_P2P_NUM_RAILS": "2"})
    idle = [p for p in problems(report) if "stay idle" in p]
    assert len(idle) == 8 and "2 rail(s) on 4 NICs" in idle[0]


def test_warns_shm_chosen_and_shm_fast(tmp_path):
    report, _ = aws_report(p5(tmp_path), provider="shm", env={"TORCH_P2P_PROVIDER": "shm", "TORCH_P2P_SHM_FAST": "1"})
    found = problems(report)
    assert any("shm is chosen" in p for p in found) and any("SHM_FAST" in p for p in found)


def test_warns_cma_off_under_yama_scope_2(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "ptrace_scope", lambda: 2)
    report, _ = aws_report(p5(tmp_path), env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    assert any("ptrace_scope is 2: the cma route is off" in p for p in problems(report))
    assert report["routes"][0] == {"from": "cpu", "to": "cpu", "route": "efa, direct"}
    monkeypatch.setattr(doctor, "ptrace_scope", lambda: 1)
    report, _ = aws_report(p5(tmp_path / "b"), env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    assert not any("ptrace_scope" in p for p in problems(report))
    assert report["routes"][0]["route"] == "cma"


def test_warns_ptrace_opened_to_any(tmp_path, monkeypatch):
    """TORCH_P2P_CMA_PTRACE=any opens the process to every process of the user: a warning where
    Yama's scope 1 would otherwise keep it closed, none where nothing is opened."""
    env = {"FI_EFA_USE_DEVICE_RDMA": "1", "TORCH_P2P_CMA_PTRACE": "any"}
    monkeypatch.setattr(doctor, "ptrace_scope", lambda: 1)
    report, _ = aws_report(p5(tmp_path), env=env)
    assert any("TORCH_P2P_CMA_PTRACE=any: every process of this user" in p for p in problems(report))
    assert "every process of this user" in report["ptrace"]
    report, _ = aws_report(p5(tmp_path / "a"), env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    assert "lets one same-host peer" in report["ptrace"] and not any("PTRACE" in p for p in problems(report))
    monkeypatch.setattr(doctor, "ptrace_scope", lambda: 0)
    report, _ = aws_report(p5(tmp_path / "b"), env=env)
    assert not any("TORCH_P2P_CMA_PTRACE" in p for p in problems(report))


def test_says_how_a_failed_call_stops_and_warns_when_it_would_not(tmp_path):
    """Each provider's way of stopping a failed call is in the report (efa's limit named), and
    FI_AV_REMOVE_CLEANUP=0, which keeps a dead peer's connections, is a warning."""
    env = {"FI_EFA_USE_DEVICE_RDMA": "1"}
    report, _ = aws_report(p5(tmp_path), env=env)
    assert "cannot revoke the keys" in report["failed_calls"]
    assert "a failed call (efa): " in doctor.render(report, [])
    report, _ = aws_report(p5(tmp_path / "a"), provider="tcp", env={"TORCH_P2P_PROVIDER": "tcp"})
    assert "connections are cut" in report["failed_calls"]
    assert ("read response half received" in report["failed_calls"]) == (p2p._C.libfabric_version() < (1, 18))
    assert not any("FI_AV_REMOVE_CLEANUP" in p for p in problems(report))
    report, _ = aws_report(p5(tmp_path / "b"), env={**env, "FI_AV_REMOVE_CLEANUP": "0"})
    assert report["failed_calls"].startswith("not stopped")
    assert any("FI_AV_REMOVE_CLEANUP is off" in p for p in problems(report))


def test_no_provider_at_all():
    report = doctor.collect(env={}, offers={p: ABSENT for p in doctor.PROVIDERS}, gpu_pcis=[])
    assert report["default_provider"] is None
    assert problems(report) == ["no libfabric provider with RDM endpoints and RMA was found"]
