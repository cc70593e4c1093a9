"""CPU/gloo shims that let megatron-core (0.19.2 tested) build, train and optimise on a
CPU-only torch.

Applied only when CUDA is unavailable (`apply_cpu_shims` is a no-op otherwise) and at most
once per process. Each shim names the Megatron call it replaces and why:

1. CUDA device arguments (`wrap_device_entry_points`): ~150 sites create tensors with
   `device=torch.cuda.current_device()` or `device='cuda'` (DDP grad buffers, FP32Optimizer,
   the schedules' token counters, clip-grad norm, the sequence-parallel all-gather in
   `LinearWithGradAccumulationAndAsyncCommunication.backward`). The torch factory functions
   Megatron calls with a device (`torch.empty`, `zeros`, `ones`, `full`, `tensor`, `arange`,
   `rand*`, `*_like`, ...), the `Tensor.new_*` methods and `Tensor.to` are wrapped to map any CUDA device (a bare int
   ordinal, 'cuda', 'cuda:N', torch.device('cuda')) to CPU. Wrapping the module attributes,
   rather than a TorchFunctionMode, also covers autograd backward functions (a mode is
   popped while its own handler runs `torch.autograd.backward`) and every thread.
   - `Tensor.cuda()` (`language_module.setup_embeddings_and_output_layer` calls
     `weight.data.cuda()` for tied embeddings with PP>1) returns the tensor itself.
   - `Tensor.type()` with no argument reports the CUDA type name ('torch.cuda.FloatTensor')
     for CPU tensors, because `clip_grads.py` asserts that string and
     `distrib_optimizer.py` / `optimizer.py` reject other type names. Only in processes that
     run Megatron on CPU; nothing in dhelix relies on `Tensor.type()`.
2. `torch.cuda` API stand-ins: `current_device` returns 0 (mapped to CPU by the mode),
   `current_stream`/`default_stream`/`Stream`/`Event` return no-op objects, `synchronize` and
   the memory counters are no-ops, so the schedules, DDP and the timers run unchanged.
   (`p2p_communication.py` calls `torch.cuda.synchronize()` unless `batch_p2p_sync=False`.)
3. RNG (`megatron_patches.rng`): `CudaRNGStatesTracker.add/fork` use
   `torch.cuda.get_rng_state`; replaced by a tracker that keeps CPU generator states.

4. Allocator (`megatron_patches.cpu_allocator`): CUDA's caching allocator keeps freed
   blocks; glibc gives them back to the kernel and re-faults their pages on the next step,
   at a cost that depends on the order tensors are freed in. glibc is told to keep them.

5. MoE split sizes (`megatron_patches.cpu_shims._patch_moe_split_sizes`): the all-to-all
   token dispatcher hands `all_to_all_single` its split sizes through
   `moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA
   tensors; a CPU tensor stays a tensor, and torch's binding refuses it as a list of sizes.
   On CPU the same function returns the numpy array the CUDA path returns.

6. Uneven first-dimension gathers (`_patch_uneven_sequence_gathers`): with tensor and
   expert parallelism and sequence parallelism, the MoE dispatcher all-gathers and
   reduce-scatters token blocks of different lengths per rank
   (`tensor_parallel.mappings._gather_along_first_dim(..., output_split_sizes)` and
   `_reduce_scatter_along_first_dim(..., input_split_sizes)`, through
   `torch.distributed.all_gather`/`reduce_scatter` with tensor lists), which NCCL takes and
   gloo refuses ("invalid tensor size"). On CPU the blocks are padded to the longest, moved
   with the equal-size collective, and cut back: the same values.

The sequence-parallel LayerNorm trap is handled where the model is built
(`megatron_patches.norms`), not here, because it is a model-spec choice.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

_LOCK = threading.Lock()

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means an accelerator ordinal in torch factory functions and Tensor.to.
    return isinstance(device, int) and not isinstance(device, bool)


def _map_device(device):
    return _CPU if _is_cuda_device(device) else device


_FACTORY_FUNCTIONS = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace", "eye",
    "rand", "randn", "randint", "randperm", "empty_like", "zeros_like", "ones_like",
    "full_like", "rand_like", "randn_like", "empty_strided",
)
# Tensor methods that make a tensor with an optional device (megatron-core's MoE all-to-all,
# `tensor_parallel.mappings._AllToAll`, calls `input.new_empty(..., device=
# torch.cuda.current_device())` for unequal splits)
_TENSOR_FACTORY_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _with_cpu_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__dhelix_original__ = fn
    return wrapper


def _tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and not isinstance(args[0], (torch.Tensor, torch.dtype)):
            args = (_map_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _tensor_type(original):
    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return _CUDA_TYPE_NAMES.get(name, name)

    return type_


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=None):
    return self


def wrap_device_entry_points() -> None:
    """Install the CUDA-device-to-CPU wrappers on torch (see the module docstring)."""
    for name in _FACTORY_FUNCTIONS:
        setattr(torch, name, _with_cpu_device(getattr(torch, name)))
    for name in _TENSOR_FACTORY_METHODS:
        setattr(torch.Tensor, name, _with_cpu_device(getattr(torch.Tensor, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.type = _tensor_type(torch.Tensor.type)
    torch.Tensor.cuda = _tensor_cuda


class _NoOpStream:
    """Stand-in for torch.cuda.Stream on CPU: work is synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or _NoOpEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NoOpEvent:
    """Stand-in for torch.cuda.Event on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        raise RuntimeError("CUDA event timing is not available on CPU; use time.perf_counter")


_DEFAULT_STREAM = _NoOpStream()


def _patch_cuda_api() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None


def _patch_moe_split_sizes() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _gather_uneven(input_, group, output_split_sizes):
    """All-gather along dim 0 where rank r contributes `output_split_sizes[r]` rows."""
    import torch.distributed as dist

    longest = max(output_split_sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    blocks = [torch.empty_like(padded) for _ in output_split_sizes]
    dist.all_gather(blocks, padded, group=group)
    return torch.cat([block[:rows] for block, rows in zip(blocks, output_split_sizes)])


def _reduce_scatter_uneven(input_, group, input_split_sizes):
    """Reduce-scatter along dim 0 where rank r receives the sum of every rank's
    `input_split_sizes[r]`-row block r."""
    import torch.distributed as dist

    longest = max(input_split_sizes)
    stacked = input_.new_zeros((len(input_split_sizes), longest, *input_.shape[1:]))
    for r, block in enumerate(torch.split(input_, input_split_sizes, dim=0)):
        stacked[r, : block.shape[0]] = block
    dist.all_reduce(stacked, group=group)
    rank = group.rank()
    return stacked[rank, : input_split_sizes[rank]].clone()


def _with_uneven_splits(original, uneven):
    """`mappings._gather_along_first_dim` / `_reduce_scatter_along_first_dim` that hand a
    call with per-rank split sizes over a group of more than one rank to `uneven`
    (`_gather_uneven` / `_reduce_scatter_uneven`) and every other call to `original`."""

    @functools.wraps(original)
    def along_first_dim(input_, group, split_sizes=None, use_global_buffer=False):
        if split_sizes is None or group.size() == 1:
            return original(input_, group, split_sizes, use_global_buffer)
        return uneven(input_, group, list(split_sizes))

    return along_first_dim


def _patch_uneven_sequence_gathers() -> None:
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _with_uneven_splits(
        mappings._gather_along_first_dim, _gather_uneven)
    mappings._reduce_scatter_along_first_dim = _with_uneven_splits(
        mappings._reduce_scatter_along_first_dim, _reduce_scatter_uneven)


def cpu_shims_active() -> bool:
    """True once `apply_cpu_shims` has installed the shims in this process (read off the
    patch itself: the wrapped factory functions keep their original)."""
    return hasattr(torch.empty, "__dhelix_original__")


def apply_cpu_shims() -> bool:
    """Install the CPU shims if CUDA is unavailable. Idempotent and thread-safe.

    Returns True when the shims are (now) active, False on a CUDA machine where nothing is
    changed. Must run before the first megatron-core model or optimizer is built.
    """
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if cpu_shims_active():
            return True
        from megatron_patches.compat import check_supported_megatron
        from megatron_patches.cpu_allocator import keep_freed_memory
        from megatron_patches.rng import install_cpu_rng_tracker

        check_supported_megatron()
        _patch_cuda_api()
        install_cpu_rng_tracker()
        keep_freed_memory()
        _patch_moe_split_sizes()
        _patch_uneven_sequence_gathers()
        # Last: cpu_shims_active() turns True only once everything is installed.
        wrap_device_entry_points()
        return True
