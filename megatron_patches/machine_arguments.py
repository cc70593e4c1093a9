"""Megatron's parsed arguments adapted to the machine a run starts on (megatron-core 0.19.2
tested): the one place that decides which of Megatron's defaults this machine cannot honour,
and which launches it cannot run at all.

Called by the argument hook of `megatron_patches.training_hooks` right after parsing, before
Megatron validates anything and before any process group exists, for every run through
`python -m dhelix.megatron_lm` (stock and `--dhelix` alike, so the two are comparable).
Each adaptation is taken only when what it works around is missing, and rank 0 prints one
line naming each (setting and why). The conditions, read off megatron-core 0.19.2:

- no CUDA: `--distributed-backend gloo` (nccl needs GPUs), `--no-persist-layer-norm` and
  every CUDA kernel fusion off (`gradient_accumulation_fusion`, `bias_gelu_fusion`,
  `bias_swiglu_fusion`, `bias_dropout_fusion`, `masked_softmax_fusion`,
  `apply_rope_fusion`): Megatron's unfused torch code computes the same math on the CPU.
- Transformer Engine missing: `--transformer-impl local` (Megatron's default spec needs
  TE), and with RoPE `apply_rope_fusion` off (`TransformerConfig.__post_init__` raises
  "apply_rope_fusion is not available. Please install TE >= 1.4.": the fused kernel is
  TE's `fused_apply_rotary_pos_emb`).
- local spec without NVIDIA Apex: `--no-persist-layer-norm` (the spec's norm is then
  `WrappedTorchNorm`, which asserts "persist_layer_norm not supported by torch
  LayerNorm").
- Apex's `fused_weight_gradient_mlp_cuda` missing: `--no-gradient-accumulation-fusion`
  (`ColumnParallelLinear.__init__` raises; the output layer is that class under every
  spec).
- local spec without Apex's fused softmax kernels: `--no-masked-softmax-fusion`
  (`FusedScaleMaskSoftmax` imports `scaled_upper_triang_masked_softmax_cuda` at the first
  fp16/bf16 forward and fails there).

Refused (`MachineRefused`, one `error:` line from the argument hook, exit code 2): more
ranks on this node than GPUs, whatever `--distributed-backend` says. NCCL refuses two ranks
on one GPU, and gloo cannot carry Megatron's gradient all-reduce of CUDA tensors: measured
on one H100 (torch 2.11, megatron-core 0.19.2), 4 ranks of stock Megatron on one GPU over
gloo (TP2 + SP x DP2) failed in the first step's gradient sync,
`param_and_grad_buffer.start_grad_sync` -> `torch.distributed._coalescing_manager` ->
`allreduce_coalesced`: "RuntimeError: ProcessGroupGloo::allreduce_coalesced: unsupported
device type cuda". (This module used to run such ranks over gloo on
`cuda:(local rank mod GPUs)`; that is the run that failed.)

Not adapted: `CUDA_DEVICE_MAX_CONNECTIONS=1`, which Megatron's `validate_args` demands with
TP or CP > 1 before Blackwell, is an environment variable CUDA reads when it creates its
context; set it on the command line (DHelix's lanes then run their kernels in order, see
`dhelix.runtime.lanes.check_cuda_device_max_connections`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Megatron's CUDA kernel fusions (argument name -> the flag that turns it off), all off
# without CUDA.
CUDA_FUSIONS = {"gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
                "bias_gelu_fusion": "--no-bias-gelu-fusion",
                "bias_swiglu_fusion": "--no-bias-swiglu-fusion",
                "bias_dropout_fusion": "--no-bias-dropout-fusion",
                "masked_softmax_fusion": "--no-masked-softmax-fusion",
                "apply_rope_fusion": "--no-rope-fusion"}


@dataclass(frozen=True)
class Machine:
    """What the adaptations and the refusal depend on. `local_ranks`: the ranks torchrun
    started on this node (LOCAL_WORLD_SIZE)."""

    cuda: bool
    gpus: int
    local_ranks: int
    transformer_engine: bool
    apex_fused_layer_norm: bool
    fused_wgrad_kernel: bool
    fused_softmax_kernels: bool

    @classmethod
    def probe(cls) -> "Machine":
        """This process's machine (imports the optional packages to find out)."""
        from megatron_patches.compat import (
            FUSED_SOFTMAX_EXTENSIONS,
            FUSED_WGRAD_EXTENSION,
            has_apex_fused_layer_norm,
            has_transformer_engine,
            importable,
        )

        cuda = torch.cuda.is_available()
        return cls(
            cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0,
            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            transformer_engine=has_transformer_engine(),
            apex_fused_layer_norm=has_apex_fused_layer_norm(),
            fused_wgrad_kernel=importable(FUSED_WGRAD_EXTENSION),
            fused_softmax_kernels=all(importable(m) for m in FUSED_SOFTMAX_EXTENSIONS))


class MachineRefused(ValueError):
    """This machine cannot run the launch whatever its arguments; the message is the one
    line that says what to do instead."""


def check_machine(machine: Machine) -> None:
    """Raises `MachineRefused` when more ranks were started on this node than it has GPUs
    (CUDA visible; without CUDA the ranks run on the CPU over gloo): neither NCCL nor gloo
    can run Megatron's training step for them (module docstring). Returns otherwise."""
    if machine.cuda and machine.local_ranks > machine.gpus:
        raise MachineRefused(
            f"more ranks on this node ({machine.local_ranks}) than GPUs ({machine.gpus}): "
            "NCCL refuses two ranks on one GPU and gloo cannot carry Megatron's gradient "
            f"all-reduce of CUDA tensors; start at most {machine.gpus} rank(s) per node "
            f"(torchrun --nproc-per-node {machine.gpus}), or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to train on the CPU")


@dataclass(frozen=True)
class Adaptation:
    """One changed argument: `setting` as it would be written on a Megatron command line,
    `reason` what on this machine requires it."""

    setting: str
    reason: str

    def __str__(self) -> str:
        return f"{self.setting} ({self.reason})"


def _uses_rope(args) -> bool:
    return args.position_embedding_type == "rope" or bool(
        getattr(args, "use_rotary_position_embeddings", False))


def _fusions_to_disable(args, machine: Machine, local_spec: bool) -> dict[str, str]:
    """Fusion argument -> reason, for the fusions that are on and cannot run here."""
    if not machine.cuda:
        return {name: "no CUDA" for name in CUDA_FUSIONS}
    missing = {}
    if not machine.transformer_engine and _uses_rope(args):
        missing["apply_rope_fusion"] = "its kernel is Transformer Engine's, not installed"
    if not machine.fused_wgrad_kernel:
        missing["gradient_accumulation_fusion"] = (
            "Apex's fused_weight_gradient_mlp_cuda is not installed")
    if local_spec and not machine.fused_softmax_kernels:
        missing["masked_softmax_fusion"] = "Apex's fused softmax kernels are not installed"
    return missing


def adapt_arguments(args, machine: Machine) -> tuple[Adaptation, ...]:
    """Change Megatron's parsed `args` in place where `machine` cannot honour them (the
    module docstring lists each condition) and return what changed, in order. Changes
    nothing a run can honour: on a machine with Transformer Engine and Apex and a GPU per
    rank, returns (). Does not check the machine itself (`check_machine` does)."""
    done: list[Adaptation] = []
    if not machine.cuda and args.distributed_backend == "nccl":
        args.distributed_backend = "gloo"
        done.append(Adaptation("--distributed-backend gloo", "no CUDA"))
    if args.transformer_impl == "transformer_engine" and not machine.transformer_engine:
        args.transformer_impl = "local"
        done.append(Adaptation("--transformer-impl local",
                               "Transformer Engine is not installed"))
    local_spec = args.transformer_impl == "local"
    if not args.no_persist_layer_norm:
        reason = ("no CUDA" if not machine.cuda else
                  "NVIDIA Apex is not installed: the local spec's torch norm refuses it"
                  if local_spec and not machine.apex_fused_layer_norm else None)
        if reason:
            args.no_persist_layer_norm = True
            done.append(Adaptation("--no-persist-layer-norm", reason))
    missing = _fusions_to_disable(args, machine, local_spec)
    for name, flag in CUDA_FUSIONS.items():
        reason = missing.get(name)
        if reason and getattr(args, name, False):
            setattr(args, name, False)
            done.append(Adaptation(flag, reason))
    return tuple(done)


def adaptations_line(adaptations: tuple[Adaptation, ...]) -> str:
    """The one line rank 0 prints ('' when nothing was adapted)."""
    if not adaptations:
        return ""
    return "dhelix: adapted to this machine: " + "; ".join(str(a) for a in adaptations)


def adapt_to_this_machine(args) -> tuple[Adaptation, ...]:
    """`check_machine`, then `adapt_arguments`, for this process's machine; rank 0
    (`args.rank`) prints the line. Raises `MachineRefused` before changing `args`."""
    machine = Machine.probe()
    check_machine(machine)
    adaptations = adapt_arguments(args, machine)
    if adaptations and args.rank == 0:
        print(adaptations_line(adaptations), flush=True)
    return adaptations
