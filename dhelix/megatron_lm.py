"""Run an unmodified Megatron-LM pretrain script with dhelix switched in.

    torchrun --nproc-per-node 4 -m dhelix.megatron_lm scripts/pretrain_gpt.py
        <Megatron arguments> [--dhelix [--dhelix-plan PLAN | --dhelix-profile PROFILE]]

The script runs as `__main__` (as `python SCRIPT ARGS` would run it, its directory first on
`sys.path`) after two things are installed in this process:

- on a CPU-only machine, the CPU/gloo shims for megatron-core and `megatron.training`
  (`megatron_patches.training_shims`);
- the hooks that add the `--dhelix*` arguments to Megatron's parser and, with `--dhelix`,
  build the folded model (PP > 1) and hand `train()` and `evaluate()` the DHelix schedule
  (`megatron_patches.training_hooks`). Without `--dhelix` they change nothing.
"""

from __future__ import annotations

import os
import runpy
import sys
import warnings

USAGE = ("usage: python -m dhelix.megatron_lm SCRIPT [Megatron arguments] [--dhelix "
         "[--dhelix-plan PLAN | --dhelix-profile PROFILE] ...]")


def _quiet_known_warnings() -> None:
    # Chatter from megatron-core/torch internals that users cannot act on (optional
    # Transformer Engine / Apex imports, deprecations).
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")


def install_plugin() -> None:
    """Install the CPU shims (on a CPU-only machine), the sequence-parallel torch norm (on
    every machine where the local spec's norm is torch's) and the training hooks in this
    process, and share one gloo device among its groups where asked
    (`dhelix.gloo_device`) (idempotent; `dhelix train` also parses its arguments with them
    before launching)."""
    from dhelix.gloo_device import share_gloo_device_if_asked
    from megatron_patches.norms import install_sequence_parallel_torch_norm
    from megatron_patches.training_hooks import install_training_hooks
    from megatron_patches.training_shims import apply_training_cpu_shims

    _quiet_known_warnings()
    share_gloo_device_if_asked()
    apply_training_cpu_shims()
    install_sequence_parallel_torch_norm()
    install_training_hooks()


def run_script(script: str, args: list[str]) -> None:
    """Install the shims and hooks, then run `script` with `args` as its `sys.argv[1:]`."""
    install_plugin()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def close_process_groups() -> None:
    """Destroy every process group left alive (`megatron.training.pretrain` returns with
    Megatron's groups and the DHelix lanes open). A process that exits with gloo's worker
    threads still running can abort in their destructors after training has finished
    ("terminate called without an active exception", SIGABRT: seen in 2 of 4 full test
    runs); torch's own advice is to destroy the groups before exiting."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def tear_down_pretrain(groups_before: list) -> None:
    """After `pretrain()` in a process that goes on to build another run (the step harness,
    tests): forget the plugin's last run (`training_hooks._Run.forget`), tear down
    Megatron's global state (`destroy_global_state`), destroy the process groups made since
    `groups_before` (an earlier `dhelix.parallel.process_groups()`) and collect garbage, so
    the run's model, optimizer and gloo transport threads are freed once no caller holds
    them (a gloo group's threads end only when it is destroyed and its last reference
    goes). Collective: every rank calls it at the same point. Freezes the objects left
    (`gc.freeze`), so the next teardown's collection costs less."""
    import gc

    from megatron.training.training import destroy_global_state

    from dhelix.parallel import destroy_process_groups_since
    from megatron_patches.training_hooks import _Run

    _Run.forget()
    destroy_global_state()
    destroy_process_groups_since(groups_before)
    gc.collect()  # the run's reference cycles (modules, hooks, closures)
    # what is left is live (imported modules, their caches): later collections skip it (a
    # teardown's collection took 0.5 s a rank, 0.2 s with the rest frozen); an object frozen
    # now that later becomes cyclic garbage is not reclaimed
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1], file=sys.stderr)
        return 0 if argv else 2
    script, *args = argv
    if not os.path.isfile(script):
        print(f"error: SCRIPT {script} is not a file; pass a Megatron-LM pretrain script, "
              "e.g. scripts/pretrain_gpt.py", file=sys.stderr)
        return 2
    run_script(script, args)
    close_process_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
