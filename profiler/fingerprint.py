"""Hardware fingerprint of a profiling job, and the check that a profile fits this machine.

A profile's times are only valid on the hardware and software they were measured on. The
fingerprint records, as a JSON object (the profile's `hardware` section):

    {"fingerprint": "dhelix-hw-1",
     "device": "NVIDIA H100 80GB HBM3" | "cpu: <model name>"
               | "emulated GPU (<kernel profile> x S=<S>) on cpu: <model name>",
     "device_count": GPUs per node (CPU: logical cores per node),
     "nodes": N, "ranks_per_node": R,
     "link": {"intra": "nvlink" | "pcie" | "single-device" | "shared-memory",
              "inter": "<NIC hint>" | "emulated <rate>, <latency>" | "none"},
     "backend": "nccl" | "gloo",
     "versions": {"torch", "cuda", "nccl", "gloo", "megatron-core", "python"}}
    ("cuda" and "nccl" are "none" when no GPU is in use, also with a CUDA build of torch.)

`MATCH_FIELDS` are the fields that must be equal for a profile to be used on this machine
(`check_profile_hardware`): the device, how many per node, the links, the backend and the
versions. The node count and ranks per node are recorded for the reader but not compared:
a job with other node counts uses other channels, whose cost keys (`.../g<size>/<channel>`)
the coverage check (`planner.costs.check_profile_covers`) already tells apart.
"""

from __future__ import annotations

import json
import os
import platform
import re
from importlib import metadata

from dhelix.file_formats import REGENERATE, FormatError
from dhelix.topology import NodeTopology

FINGERPRINT_VERSION = "dhelix-hw-1"
MATCH_FIELDS = ("fingerprint", "device", "device_count", "link", "backend", "versions")
CLUSTER_LINK_ENV = "DHELIX_CLUSTER_LINK"  # set by the emulated cluster (dhelix.cluster)
# set in a process timing on the emulated GPU (dhelix.gpu_emulation.options.mark_process)
EMULATION_ENV = "DHELIX_GPU_EMULATION"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _nccl_version(torch) -> str:
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _intra_link(torch) -> str:
    """NVLink or PCIe between the GPUs of a node (NVML when available, else peer access)."""
    if not torch.cuda.is_available():
        return "shared-memory"
    count = torch.cuda.device_count()
    if count < 2:
        return "single-device"
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                    return "nvlink"
            except pynvml.NVMLError:
                break
        return "pcie"
    except Exception:  # noqa: BLE001 - no NVML: fall back to peer access as the hint
        return "pcie-p2p" if torch.cuda.can_device_access_peer(0, 1) else "pcie"


def _inter_link(nodes: int) -> str:
    """What connects the nodes: the emulated cluster's shaped link, InfiniBand devices, or
    the socket interface NCCL/gloo were told to use."""
    if nodes <= 1:
        return "none"
    emulated = os.environ.get(CLUSTER_LINK_ENV)
    if emulated:
        return f"emulated {emulated}"
    try:
        ib = sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        ib = []
    if ib:
        return "infiniband " + ",".join(ib)
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if os.environ.get(name):
            return f"socket {os.environ[name]}"
    return "socket"


def hardware_fingerprint(world_size: int, topology: NodeTopology | None = None,
                         backend: str | None = None) -> dict:
    """This machine's fingerprint for a job of `world_size` ranks (no collectives: nodes
    are assumed alike; the profiler checks that every rank computed the same one)."""
    import torch

    topology = topology or NodeTopology.detect()
    ranks_per_node = topology.ranks_per_node or world_size
    nodes = -(-world_size // ranks_per_node)
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = (torch.distributed.get_backend() if torch.distributed.is_initialized()
                   else "nccl" if cuda else "gloo")
    versions = {
        "torch": torch.__version__,
        # a CUDA build of torch on a machine without a GPU runs on CPU: no CUDA in use
        "cuda": (torch.version.cuda or "none") if cuda else "none",
        "nccl": _nccl_version(torch) if cuda else "none",
        "gloo": "available" if torch.distributed.is_gloo_available() else "missing",
        "megatron-core": _version("megatron-core"),
        "python": platform.python_version(),
    }
    device = torch.cuda.get_device_name(0) if cuda else f"cpu: {_cpu_model()}"
    if os.environ.get(EMULATION_ENV):  # timing on the emulated GPU (dhelix.gpu_emulation)
        device = f"emulated GPU ({os.environ[EMULATION_ENV]}) on {device}"
    return {
        "fingerprint": FINGERPRINT_VERSION,
        "device": device,
        "device_count": torch.cuda.device_count() if cuda else (os.cpu_count() or 1),
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "link": {"intra": _intra_link(torch), "inter": _inter_link(nodes)},
        "backend": backend,
        "versions": versions,
    }


def hardware_differences(recorded, current: dict) -> list[str]:
    """The `MATCH_FIELDS` in which a recorded fingerprint differs from `current`, as
    'field: profile has X, this machine has Y' lines (a string fingerprint - not made by
    `dhelix profile` - differs in everything)."""
    if not isinstance(recorded, dict) or recorded.get("fingerprint") != FINGERPRINT_VERSION:
        return [f"fingerprint: profile has {recorded!r}, which is not a `dhelix profile` "
                f"hardware fingerprint ({FINGERPRINT_VERSION})"]
    return [f"{name}: profile has {recorded.get(name)!r}, this machine has {current[name]!r}"
            for name in MATCH_FIELDS if recorded.get(name) != current[name]]


def describe_hardware(hardware) -> str:
    """One line for logs: device x count, nodes, links, backend, torch version."""
    if not isinstance(hardware, dict):
        return str(hardware)
    link = hardware.get("link", {})
    return (f"{hardware.get('device')} x{hardware.get('device_count')} per node, "
            f"{hardware.get('nodes')} node(s), intra {link.get('intra')}, inter "
            f"{link.get('inter')}, {hardware.get('backend')}, torch "
            f"{hardware.get('versions', {}).get('torch')}")


def check_profile_hardware(profile, path, current: dict) -> None:
    """Refuse (FormatError naming the file, every differing field and `dhelix profile`) a
    profile that was measured on other hardware or software than `current`."""
    differences = hardware_differences(profile.hardware, current)
    if differences:
        raise FormatError(
            f"{path}: profile was measured on other hardware or software than this machine "
            f"({'; '.join(differences)}); its times do not apply here: profile this machine "
            f"with `{REGENERATE['profile']}`")


def _layer_relevant(fingerprint):
    """A run fingerprint without the pipeline size (`-pp<N>`), which does not change a
    layer's operators: a TP=2 profile serves TP=2 x PP=2 training."""
    return re.sub(r"-pp\d+", "", fingerprint) if isinstance(fingerprint, str) else fingerprint


def check_profile_run(profile, path, model: str | None, parallel: str | None) -> None:
    """Refuse a profile whose recorded model / parallel fingerprints (meta, written by
    `dhelix profile`) differ from this run's (None: not compared; the pipeline size is
    not compared)."""
    problems = [f"{name}: profile has {profile.meta.get(name)!r}, this run has {value!r}"
                for name, value in (("model", model), ("parallel", parallel))
                if value is not None and name in profile.meta
                and _layer_relevant(profile.meta[name]) != _layer_relevant(value)]
    if problems:
        raise FormatError(
            f"{path}: profile was measured for another configuration ({'; '.join(problems)}); "
            f"regenerate it with `{REGENERATE['profile']}` and this run's arguments")


def plan_hardware_differences(plan_hardware: str, current: dict) -> list[str]:
    """For a plan's `hardware` fingerprint string: the differences from `current` when it
    is a `dhelix profile` fingerprint (canonical JSON), else [] (analytic or hand-written
    hardware strings say nothing about a machine)."""
    try:
        recorded = json.loads(plan_hardware)
    except (TypeError, ValueError):
        return []
    if not isinstance(recorded, dict) or recorded.get("fingerprint") != FINGERPRINT_VERSION:
        return []
    return hardware_differences(recorded, current)
