"""Version compatibility for megatron-core: the one place that knows version differences.

Supported: megatron-core 0.19 (0.19.2 tested; requirements.txt pins it). Older releases are
refused at start-up: 0.16 and earlier lack `megatron.training` and take other arguments in
the calls dhelix makes (e.g. `schedules.backward_step`, the checkpoint save strategy). Code
elsewhere asks this module instead of comparing version strings itself.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from packaging.version import Version

MIN_MEGATRON_CORE = Version("0.19.0")


def megatron_core_version() -> Version:
    """Installed megatron-core version (raises a clear error when it is missing)."""
    try:
        return Version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError as exc:  # pragma: no cover - install problem
        raise RuntimeError(
            "megatron-core is not installed; run `bash scripts/install.sh`"
        ) from exc


def check_supported_megatron() -> Version:
    """Return the version, or raise if it is older than the supported range."""
    version = megatron_core_version()
    if version < MIN_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron-core {version} is too old for dhelix (need >= {MIN_MEGATRON_CORE}); "
            "run `bash scripts/install.sh`"
        )
    return version


def importable(module: str) -> bool:
    """True when `module` imports (False on ImportError, or on a broken CUDA install raising
    at import)."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any failure means megatron-core cannot use it either
        return False
    return True


def has_transformer_engine() -> bool:
    """True when Transformer Engine's PyTorch extension imports."""
    return importable("transformer_engine.pytorch")


def has_apex_fused_layer_norm() -> bool:
    """True when NVIDIA Apex's fused layer norm imports (what megatron-core's
    `FusedLayerNorm` needs; PyPI's unrelated `apex` package does not provide it)."""
    return importable("apex.normalization.fused_layer_norm")


# The CUDA extensions megatron-core imports by these names (built by NVIDIA Apex with
# --cpp_ext --cuda_ext): the fused weight-gradient accumulation of its linear layers, and
# the fused softmax kernels of its local (unfused) attention.
FUSED_WGRAD_EXTENSION = "fused_weight_gradient_mlp_cuda"
FUSED_SOFTMAX_EXTENSIONS = ("scaled_upper_triang_masked_softmax_cuda",
                            "scaled_masked_softmax_cuda", "scaled_softmax_cuda")


def optimizer_state_loadable(optimizer) -> bool:
    """Whether megatron-core can load this optimizer's state from a distributed checkpoint.

    megatron-core 0.19.2 (as 0.16.1) builds SGD without a state initialiser
    (`init_state_fn is None`), so `sharded_state_dict(is_loading=True)` raises a bare
    TypeError; callers check this first and ask the user for `--no-load-optim` instead
    (tests/test_layout_parity.py holds this).
    """
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return all(getattr(opt, "init_state_fn", None) is not None for opt in inner)


def use_prebuilt_dataset_helpers() -> bool:
    """Make `megatron.core.datasets.utils.compile_helpers` a no-op when the compiled dataset
    helpers (`megatron.core.datasets.helpers_cpp`) already import.

    Replaces: `compile_helpers`, which `megatron.training.initialize._compile_dependencies`
    runs on rank 0 at start-up as `make -C .../megatron/core/datasets`. The megatron-core
    wheel ships the compiled `helpers_cpp` module but no Makefile, so `make` fails and rank 0
    exits. Returns True when the patch was installed (False: the helpers do not import, and
    Megatron's own compile step runs as before)."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    from megatron.core.datasets import utils

    utils.compile_helpers = lambda: None
    return True
