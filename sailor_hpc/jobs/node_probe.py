"""What a rank sees on a compute node, printed as one JSON line: the facts ``sailor-hpc site doctor`` compares
with the site file.

It runs as a rank of every job does (in the site's container, under the job's interpreter) and is sent as
the text of ``python -c``, so it imports nothing of sailor-hpc: an interpreter without sailor-hpc (a
container image built without it) is then a fact it reports, not a crash. Standard library only; torch
is imported if the interpreter has it, for its CUDA and NCCL view.

GPUs are seen three ways, each reported as it is, none made up: ``nvidia-smi`` (the driver's view: names,
memory), torch (what training sees), and Slurm's assignment (``CUDA_VISIBLE_DEVICES``, ``SLURM_STEP_GPUS``),
which is all a node without NVIDIA hardware (the test cluster's fake GPUs) has.
"""
from __future__ import annotations

import fcntl
import importlib.util
import ipaddress
import json
import os
import platform
import re
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

MARKER = "SAILOR-NODE-FACTS "  # the line to read among whatever else the job prints (warnings, banners)
_ENV = ("SLURMD_NODENAME", "SLURM_JOB_PARTITION", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
        "SLURM_GPUS_ON_NODE", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_NET", "GLOO_SOCKET_IFNAME",
        "CH_RUNNING", "APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "ENROOT_ROOTFS", "PYXIS_VERSION")
_SMI_TIMEOUT_S = 30


def nvidia_smi() -> dict[str, Any]:
    """The driver's view: every GPU's name and memory, the driver and the CUDA version it supports."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"found": False}
    try:
        query = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=_SMI_TIMEOUT_S)
        banner = subprocess.run([exe], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"found": True, "error": str(exc)}
    if query.returncode != 0:
        return {"found": True, "error": (query.stderr or query.stdout).strip()[-500:]}
    gpus, driver = [], None
    for line in query.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory_mib": float(parts[1]) if _number(parts[1]) else None})
            driver = parts[2]
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", banner.stdout)
    return {"found": True, "gpus": gpus, "driver": driver, "cuda": cuda.group(1) if cuda else None}


def _number(text: str) -> bool:
    return re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", text) is not None


def torch_view() -> dict[str, Any]:
    """What training sees: torch's version, its CUDA and NCCL, and the devices it can use."""
    if importlib.util.find_spec("torch") is None:
        return {"found": False}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken install is a fact to report (a driver it cannot load)
        return {"found": True, "error": f"{type(exc).__name__}: {exc}"[:500]}
    out: dict[str, Any] = {"found": True, "version": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": bool(torch.cuda.is_available()), "devices": []}
    if out["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out["devices"].append({"name": props.name, "memory_mib": props.total_memory / 2**20})
        try:
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as exc:  # noqa: BLE001 - a CUDA build without NCCL says so
            out["nccl"] = None
            out["nccl_error"] = str(exc)[:200]
    return out


def _ipv4(name: str) -> str | None:
    """The interface's IPv4 address (``SIOCGIFADDR``), None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def _ipv6() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        f = line.split()
        if len(f) == 6:
            out.setdefault(f[5], []).append(str(ipaddress.IPv6Address(int(f[0], 16))))
    return out


def interfaces() -> list[dict[str, Any]]:
    """The node's network interfaces: name, state and addresses (NCCL and gloo only use one with an address)."""
    v6 = _ipv6()
    out = []
    for _, name in sorted(socket.if_nameindex()):
        state = Path(f"/sys/class/net/{name}/operstate")
        v4 = _ipv4(name)
        out.append({"name": name, "state": state.read_text().strip() if state.exists() else "unknown",
                    "addresses": ([v4] if v4 else []) + v6.get(name, [])})
    return out


def nccl_interfaces(names: list[str], ifname: str | None) -> list[str]:
    """Of the interfaces with an address, those NCCL's socket transport would use: ``NCCL_SOCKET_IFNAME`` as
    NCCL reads it (a comma list of name prefixes; ``^`` before the list excludes them, ``=`` matches names
    exactly), else InfiniBand (``ib``) ones, else every one but docker and loopback ones, else those."""
    if ifname:
        exclude, exact = ifname.startswith("^"), False
        spec = ifname.lstrip("^")
        if spec.startswith("="):
            exact, spec = True, spec[1:]
        wanted = [w for w in spec.split(",") if w]

        def hit(name: str) -> bool:
            return any(name == w if exact else name.startswith(w) for w in wanted)
        return [n for n in names if hit(n) != exclude]
    ib = [n for n in names if n.startswith("ib")]
    usable = [n for n in names if not n.startswith(("lo", "docker"))]
    return ib or usable or [n for n in names if n.startswith("docker")] or [n for n in names if n.startswith("lo")]


def read_tokens(paths: list[str]) -> dict[str, str | None]:
    """The text of each token file the login side wrote (None: not there, so not a shared folder)."""
    out: dict[str, str | None] = {}
    for p in paths:
        try:
            out[p] = Path(p).read_text().strip()
        except OSError:
            out[p] = None
    return out


def facts(tokens: list[str]) -> dict[str, Any]:
    found = interfaces()
    names = [i["name"] for i in found if i["addresses"]]
    return {
        "host": socket.gethostname(),
        "env": {k: os.environ[k] for k in _ENV if k in os.environ},
        "python": {"executable": sys.executable, "version": platform.python_version(),
                   "sailor_hpc": importlib.util.find_spec("sailor_hpc") is not None},
        "nvidia_smi": nvidia_smi(),
        "torch": torch_view(),
        "interfaces": found,
        "nccl_interfaces": nccl_interfaces(names, os.environ.get("NCCL_SOCKET_IFNAME")),
        "tokens": read_tokens(tokens),
    }


def main(argv: list[str]) -> int:
    print(MARKER + json.dumps(facts(argv)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
