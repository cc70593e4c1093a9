"""Step harness: a training run set up by `megatron.training.pretrain`, stepped by the caller.

The benchmark, the profiler and the parity tests need what `pretrain()` builds for a command
line (Megatron's parsed and validated arguments, the model chunks in DDP, the optimizer, the
LR scheduler, the data iterators, the model config `train()` completed, the forward/backward
function `train()` got: with `--dhelix`, the DHelix schedule) without Megatron's loop deciding
when to step. `build_run(script, argv)` runs SCRIPT (e.g. scripts/pretrain_gpt.py) under the
plugin (`dhelix.megatron_lm.install_plugin`) and stops `pretrain()` at its first
`megatron.training.training.train_step` call (`_hook_train_step`), so everything before that
point is Megatron's own; the returned `PretrainedRun` then calls the real `train_step` (or the
forward/backward function alone) whenever the caller asks.

Several runs can live in one process (the benchmark steps eight systems in turn): Megatron's
process state is module globals (`megatron.training.global_vars`, the micro-batch calculator,
the rerun state machine, `megatron.core.parallel_state`, the model-parallel RNG tracker, the
plugin's own `training_hooks._Run`), so each run keeps a snapshot of them (`MegatronGlobals`)
taken when `pretrain()` stopped, and `PretrainedRun.active()` puts its snapshot back for the
duration of a step. Runs built one after another with the same layout (TP, PP, folded or not)
share Megatron's process groups (`initialize_megatron` keeps an initialised parallel state);
a new layout gets new groups (every idle gloo group slows the running one: its transport
thread wakes every 10 ms). For the same reason the `--dhelix` runs of one process share their
lane process groups (`dhelix.runtime.lanes.LanePool`, `_LANES`): runs are stepped one at a
time, so a run's collectives have completed before another run uses the same lanes.

Numerics are Megatron's: a step is `train_step` with the arguments `train()` passes it. What
the harness leaves out of `train()`: its logging, evaluation, checkpoint and exit intervals
and the counters it advances after a step (`args.consumed_train_samples`), so
`PretrainedRun.iteration` counts the harness's steps. Call `close()` (or
`close_all_runs()`) when done: it tears down Megatron's global state once no run is left.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

# module -> which of its globals make up Megatron's process state
_STATE_NAMES = {
    "megatron.training.global_vars": re.compile(r"_GLOBAL_[A-Z_]+$"),
    "megatron.core.num_microbatches_calculator": re.compile(r"_GLOBAL_NUM_MICROBATCHES_CALCULATOR$"),
    "megatron.core.rerun_state_machine": re.compile(r"_GLOBAL_RERUN_STATE_MACHINE$"),
    "megatron.core.parallel_state": re.compile(r"_[A-Z][A-Z0-9_]*$"),
    "megatron.core.tensor_parallel.random": re.compile(r"_CUDA_RNG_STATE_TRACKER(_INITIALIZED)?$"),
}


class HarnessError(RuntimeError):
    """The script did not reach Megatron's training loop (e.g. `--train-iters 0`)."""


@dataclass(frozen=True)
class MegatronGlobals:
    """A snapshot of Megatron's process state (module globals, `_STATE_NAMES`) and of the
    plugin's per-run state (`training_hooks._Run`)."""

    values: dict  # (module name, global name) -> value
    plugin_run: dict

    @classmethod
    def take(cls) -> "MegatronGlobals":
        import importlib

        from megatron_patches.training_hooks import _Run

        values = {}
        for module_name, pattern in _STATE_NAMES.items():
            module = importlib.import_module(module_name)
            for name, value in vars(module).items():
                if pattern.match(name) and not isinstance(value, (ModuleType, type)):
                    values[(module_name, name)] = value
        return cls(values=values, plugin_run=dict(vars(_Run)))

    def install(self) -> None:
        import importlib

        from megatron_patches.training_hooks import _Run

        for (module_name, name), value in self.values.items():
            setattr(importlib.import_module(module_name), name, value)
        for name, value in self.plugin_run.items():
            if not name.startswith("__"):
                setattr(_Run, name, value)


@dataclass(frozen=True)
class StepOutcome:
    """One `train_step`: Megatron's loss dict (non-empty on the stage that computes the loss),
    the grad norm, whether the optimizer skipped the update, and the wall seconds of the whole
    step and of its forward/backward part (the rest is the optimizer step). On CUDA the
    device is synchronised before each time is read."""

    loss_dict: dict
    grad_norm: float
    skipped: bool
    step_s: float
    forward_backward_s: float


class _Captured(BaseException):
    """Unwinds `pretrain()` from its first `train_step` (BaseException: Megatron's and the
    plugin's `except Exception` handlers let it through)."""

    def __init__(self, call: dict):
        super().__init__("pretrain() stopped at its first train_step")
        self.call = call


_ARGS_KEY = ("megatron.training.global_vars", "_GLOBAL_ARGS")  # MegatronGlobals key of the args
_LIVE: list = []  # PretrainedRun objects not closed yet, oldest first
_LAST_LAYOUT: list = [None]
_LANES: list = [None]  # the LanePool of the runs alive in this process (created on first use)
# `dhelix.parallel.process_groups()` when the first of the runs alive was built: the groups
# made since (Megatron's, the lanes') are the runs', destroyed by `close_all_runs`
_GROUPS_BEFORE_RUNS: list = [None]


def _layout() -> tuple:
    """What decides Megatron's process groups for the parsed command line (Megatron's
    `get_args()`): TP, PP, CP, folded or not, EP and expert TP (a run of another expert
    layout must not reuse the last run's expert groups)."""
    from megatron.training import get_args

    from dhelix.folding import uses_folded_model

    args = get_args()
    return (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, uses_folded_model(args),
            args.expert_model_parallel_size, args.expert_tensor_parallel_size)


@contextlib.contextmanager
def _stopping_at_first_train_step():
    """While `pretrain()` runs: its first `train_step` call raises `_Captured` with the
    arguments `train()` passed; and Megatron's parallel state is forgotten before
    `initialize_megatron` sets up a layout other than the last run's
    (`megatron.training.initialize._initialize_distributed`); the plugin's `setup_dhelix`
    (`dhelix.runtime.setup`, looked up by `training_hooks` when the model exists) takes its
    lane groups from the pool every run of this process shares (`_LANES`)."""
    from megatron.training import initialize, training

    from dhelix.runtime import setup as dhelix_setup
    from dhelix.runtime.lanes import LanePool

    original_step = training.train_step
    original_distributed = initialize._initialize_distributed
    original_setup = dhelix_setup.setup_dhelix
    if _LANES[0] is None:
        _LANES[0] = LanePool()

    @functools.wraps(original_step)
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None, pg_collection=None,
                   p2p_communicator=None):
        raise _Captured(dict(forward_step_func=forward_step_func, data_iterator=data_iterator,
                             model=model, optimizer=optimizer,
                             opt_param_scheduler=opt_param_scheduler, config=config,
                             forward_backward_func=forward_backward_func,
                             iteration=iteration or 0, pg_collection=pg_collection,
                             p2p_communicator=p2p_communicator))

    @functools.wraps(original_distributed)
    def initialize_distributed(*args, **kwargs):
        if _LAST_LAYOUT[0] is not None and _layout() != _LAST_LAYOUT[0]:
            _forget_parallel_state()
        return original_distributed(*args, **kwargs)

    @functools.wraps(original_setup)
    def setup_dhelix(run, model_chunks, job, lane_pool=None):
        return original_setup(run, model_chunks, job, lane_pool=lane_pool or _LANES[0])

    training.train_step = train_step
    initialize._initialize_distributed = initialize_distributed
    dhelix_setup.setup_dhelix = setup_dhelix
    try:
        yield
    finally:
        training.train_step = original_step
        initialize._initialize_distributed = original_distributed
        dhelix_setup.setup_dhelix = original_setup


def _forget_parallel_state() -> None:
    """Megatron's parallel state back to uninitialised, its process groups left alive: the
    runs built before hold them (`destroy_model_parallel` would destroy the gloo DP groups)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group = destroy


def _release_megatron_globals() -> None:
    """Let the next `pretrain()` initialise Megatron: its global variables, micro-batch
    calculator and rerun state machine are cleared; the parallel state is kept (the next run
    reuses it when its layout is the same, `_stopping_at_first_train_step`)."""
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training.global_vars import destroy_global_vars

    destroy_global_vars()
    destroy_num_microbatches_calculator()
    destroy_rerun_state_machine()


def build_run(script: str, argv: list[str]) -> "PretrainedRun":
    """Run SCRIPT with ARGV under the plugin until `pretrain()` calls its first `train_step`,
    and return what it set up. Every rank of the job calls this with the same command line
    (collective: `pretrain()` initialises process groups and barriers). The process group
    must exist (torchrun's environment, or `dhelix.harness` ranks) or `pretrain()` creates it.
    A command line Megatron or the plugin refuses exits as `pretrain()` would (SystemExit)."""
    from dhelix.megatron_lm import run_script

    if _LIVE:
        _release_megatron_globals()
    elif _GROUPS_BEFORE_RUNS[0] is None:
        from dhelix.parallel import process_groups

        _GROUPS_BEFORE_RUNS[0] = process_groups()
    try:
        with _stopping_at_first_train_step():
            run_script(script, list(argv))
    except _Captured as captured:
        call = captured.call
    else:
        raise HarnessError(f"{script} returned without calling train_step (is --train-iters > 0?)")
    layout = _layout()
    run = PretrainedRun(argv=list(argv), layout=layout, **call)
    from megatron_patches.training_hooks import _Run

    run.dhelix = getattr(_Run, "setup", None)
    run.globals_at_capture = MegatronGlobals.take()
    _LIVE.append(run)
    _LAST_LAYOUT[0] = layout
    return run


@dataclass
class PretrainedRun:
    """One command line's training state as `pretrain()` set it up (see the module doc).
    `model`, `optimizer`, ... are Megatron's own objects; this object owns them until
    `close()`. Use its methods (or `with run.active():`) to run anything that reads
    Megatron's globals for this run."""

    argv: list
    layout: tuple
    forward_step_func: Callable
    data_iterator: Any
    model: list
    optimizer: Any
    opt_param_scheduler: Any
    config: Any
    forward_backward_func: Callable
    iteration: int = 0
    pg_collection: Any = None
    p2p_communicator: Any = None
    dhelix: Any = None  # dhelix.runtime.setup.DHelixSetup with --dhelix, else None
    globals_at_capture: MegatronGlobals | None = field(default=None, repr=False)
    closed: bool = False

    @property
    def args(self):
        """Megatron's parsed arguments of this run."""
        return self.globals_at_capture.values[_ARGS_KEY]

    @contextlib.contextmanager
    def active(self):
        """Megatron's globals are this run's inside the block (and stay so after it, until
        another run is activated or built)."""
        if self.closed:
            raise HarnessError("this run was closed")
        self.globals_at_capture.install()
        yield self

    def train_step(self) -> StepOutcome:
        """One iteration through Megatron's `train_step` (zero grads, the forward/backward
        function over `get_num_microbatches()` micro-batches, finalize, optimizer step, LR
        scheduler step)."""
        from megatron.training import training

        timed = _TimedForwardBackward(self.forward_backward_func)
        with self.active():
            _synchronize()
            start = time.perf_counter()
            loss_dict, skipped, *_rest, grad_norm, _zeros, _logit = training.train_step(
                self.forward_step_func, self.data_iterator, self.model, self.optimizer,
                self.opt_param_scheduler, self.config, timed, iteration=self.iteration,
                pg_collection=self.pg_collection, p2p_communicator=self.p2p_communicator)
            _synchronize()
            elapsed = time.perf_counter() - start
        self.iteration += 1
        return StepOutcome(loss_dict=loss_dict, grad_norm=float(grad_norm or 0.0),
                           skipped=bool(skipped), step_s=elapsed,
                           forward_backward_s=timed.seconds)

    def forward_backward(self, forward_only: bool = False) -> list:
        """The forward/backward function alone over one global batch, no optimizer step;
        returns the per-micro-batch loss reports (on the stage that computes the loss).
        Training (`forward_only=False`) runs it as `train_step` does: grads zeroed first,
        inside Megatron's rerun-state-machine loop (`should_run_forward_backward`, which the
        forward step's `validate_result` needs). Forward only runs it as `evaluate()` does:
        the model chunks in eval mode (train mode again after), result validation disabled
        (`RerunMode.DISABLED`, the previous mode restored after), under `torch.no_grad()`.
        Both read the run's training data iterator."""
        import torch
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

        with self.active():
            args = self.args
            call = functools.partial(
                self.forward_backward_func, forward_step_func=self.forward_step_func,
                data_iterator=self.data_iterator, model=self.model,
                num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.decoder_seq_length, forward_only=forward_only)
            rerun = get_rerun_state_machine()
            if forward_only:
                mode = rerun.get_mode()
                rerun.set_mode(RerunMode.DISABLED)
                for chunk in self.model:
                    chunk.eval()
                try:
                    with torch.no_grad():
                        return call()
                finally:
                    for chunk in self.model:
                        chunk.train()
                    rerun.set_mode(mode)
            losses = None
            while rerun.should_run_forward_backward(self.data_iterator):
                for chunk in self.model:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                losses = call()
            return losses

    def close(self) -> None:
        """Forget this run (`_drop_state`); when it was the last one alive,
        `close_all_runs` (Megatron's global state torn down, the runs' process groups
        destroyed: collective then) so a later `pretrain()` in this process starts afresh."""
        if self.closed:
            return
        self.closed = True
        self._drop_state()
        if self in _LIVE:
            _LIVE.remove(self)
        if not _LIVE:
            close_all_runs()

    def _drop_state(self) -> None:
        """Let go of the Megatron objects this run owns (model, optimizer, data iterator,
        process-group collections, the plugin's set-up, the globals' snapshot but for the
        parsed arguments, which `args` still returns): once no caller holds them either,
        their memory is freed. Their process groups stay registered with torch until
        `close_all_runs` destroys them (runs of one layout share them)."""
        kept = self.globals_at_capture
        if kept is not None:
            self.globals_at_capture = MegatronGlobals(
                values={_ARGS_KEY: kept.values.get(_ARGS_KEY)}, plugin_run={})
        self.model = self.optimizer = self.opt_param_scheduler = None
        self.data_iterator = self.forward_step_func = self.forward_backward_func = None
        self.config = self.pg_collection = self.p2p_communicator = self.dhelix = None


def close_all_runs() -> None:
    """Close every run (`PretrainedRun._drop_state`), then `tear_down_pretrain`: the
    plugin's and Megatron's global state go, the process groups made since the first of the
    runs was built (Megatron's, the plugin's lanes) are destroyed and garbage is collected,
    so what the runs held, gloo threads included, is freed once callers let go;
    idempotent. Collective: every rank calls it at the same point."""
    from dhelix.megatron_lm import tear_down_pretrain

    for run in list(_LIVE):
        run.closed = True
        run._drop_state()
    _LIVE.clear()
    _LAST_LAYOUT[0] = None
    _LANES[0] = None
    before, _GROUPS_BEFORE_RUNS[0] = _GROUPS_BEFORE_RUNS[0], None
    if before is None:  # no run built since the last close: no group is the runs'
        from dhelix.parallel import process_groups

        before = process_groups()
    tear_down_pretrain(before)


class _TimedForwardBackward:
    """Megatron's forward/backward function, timed (wall seconds, device synchronised)."""

    def __init__(self, function: Callable):
        self.function = function
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        _synchronize()
        start = time.perf_counter()
        result = self.function(*args, **kwargs)
        _synchronize()
        self.seconds += time.perf_counter() - start
        return result


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
