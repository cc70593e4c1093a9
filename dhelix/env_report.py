"""`dhelix env`: what this machine offers dhelix (versions, optional GPU packages, device)."""

from __future__ import annotations

import platform
from importlib import metadata

OPTIONAL_GPU_PACKAGES = {
    "transformer_engine": "transformer-engine",
    "flash_attn": "flash-attn",
    "apex.normalization": "apex",  # NVIDIA Apex (PyPI's `apex` is an unrelated package)
}


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def collect() -> dict:
    """A dict describing the environment; every value is a plain string/bool/int."""
    import torch

    from megatron_patches.compat import importable

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron-core": _version("megatron-core") or "missing",
        "numpy": _version("numpy") or "missing",
        "cuda_available": torch.cuda.is_available(),
        "device": "cpu",
        "device_count": 0,
        "backend": "gloo",
        "gloo_available": torch.distributed.is_gloo_available(),
        "nccl_available": torch.distributed.is_nccl_available(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
        info["backend"] = "nccl"
        info["cuda"] = torch.version.cuda
    for module, dist_name in OPTIONAL_GPU_PACKAGES.items():
        found = importable(module)
        info[dist_name] = (_version(dist_name) or "found") if found else "missing"
    return info


def run(args) -> int:
    info = collect()
    if args.short:
        print(f"dhelix env: torch {info['torch']}, megatron-core {info['megatron-core']}, "
              f"device {info['device']}, backend {info['backend']}")
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    if not info["cuda_available"]:
        print("note: no CUDA; megatron-core runs on CPU with gloo through megatron_patches")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("env", help="print torch, megatron-core, optional GPU "
                              "packages, device and backend")
    p.add_argument("--short", action="store_true", help="one line")
    p.set_defaults(func=run)
