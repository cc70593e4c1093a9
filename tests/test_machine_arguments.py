"""The arguments the plugin adapts to the machine (`megatron_patches.machine_arguments`),
through the plugin's own hook on Megatron's real `parse_args`, with CUDA and the optional
packages (Transformer Engine, NVIDIA Apex and its CUDA extensions) faked present or
missing: each machine gets exactly the adaptations its missing parts require, and rank 0
prints one line naming them."""

import sys

import pytest
import torch

from megatron_patches import compat

# A Llama-style command line (RoPE), Megatron's defaults otherwise (nccl, TE spec, fusions).
ARGV = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--position-embedding-type", "rope"]
TE = "transformer_engine.pytorch"
APEX = ("apex.normalization.fused_layer_norm", compat.FUSED_WGRAD_EXTENSION,
        *compat.FUSED_SOFTMAX_EXTENSIONS)


@pytest.fixture(scope="module")
def parse_args():
    from megatron.training import arguments

    from megatron_patches.training_hooks import install_training_hooks

    install_training_hooks()
    return arguments.parse_args


def _parse(parse_args, monkeypatch, *, gpus: int, installed=(), ranks: int = 1,
           rank: int = 0, argv=ARGV):
    """Megatron's arguments as the hooked parser leaves them on a machine with `gpus` GPUs
    (0: no CUDA), `installed` optional modules and `ranks` local ranks, on rank `rank`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(compat, "importable", lambda module: module in installed)
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", ranks),
                        ("LOCAL_WORLD_SIZE", ranks)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(sys, "argv", list(argv))
    return parse_args()


def _line(capsys) -> list[str]:
    return [l for l in capsys.readouterr().out.splitlines() if l.startswith("dhelix:")]


def test_gpu_without_te_or_apex_gets_the_local_spec_and_no_fused_kernels(
        parse_args, monkeypatch, capsys):
    args = _parse(parse_args, monkeypatch, gpus=1)
    assert _line(capsys) == [
        "dhelix: adapted to this machine: --transformer-impl local (Transformer Engine is "
        "not installed); --no-persist-layer-norm (NVIDIA Apex is not installed: the local "
        "spec's torch norm refuses it); --no-gradient-accumulation-fusion (Apex's "
        "fused_weight_gradient_mlp_cuda is not installed); --no-masked-softmax-fusion "
        "(Apex's fused softmax kernels are not installed); --no-rope-fusion (its kernel is "
        "Transformer Engine's, not installed)"]
    assert (args.transformer_impl, args.no_persist_layer_norm) == ("local", True)
    assert not (args.gradient_accumulation_fusion or args.masked_softmax_fusion
                or args.apply_rope_fusion)
    # what a GPU runs without TE or Apex stays: nccl, torch's jit-fused bias functions
    assert args.distributed_backend == "nccl"
    assert args.bias_gelu_fusion and args.bias_swiglu_fusion and args.bias_dropout_fusion


def test_gpu_with_te_keeps_its_spec_and_rope_fusion(parse_args, monkeypatch, capsys):
    args = _parse(parse_args, monkeypatch, gpus=1, installed=(TE,))
    assert _line(capsys) == [
        "dhelix: adapted to this machine: --no-gradient-accumulation-fusion (Apex's "
        "fused_weight_gradient_mlp_cuda is not installed)"]
    assert args.transformer_impl == "transformer_engine"
    assert args.apply_rope_fusion and args.masked_softmax_fusion
    assert not args.no_persist_layer_norm


def test_gpu_with_te_and_apex_is_left_alone(parse_args, monkeypatch, capsys):
    args = _parse(parse_args, monkeypatch, gpus=1, installed=(TE, *APEX))
    assert _line(capsys) == []
    assert args.transformer_impl == "transformer_engine"
    assert args.gradient_accumulation_fusion and args.apply_rope_fusion


def test_cpu_gets_gloo_and_every_fusion_off(parse_args, monkeypatch, capsys):
    args = _parse(parse_args, monkeypatch, gpus=0)
    assert _line(capsys) == [
        "dhelix: adapted to this machine: --distributed-backend gloo (no CUDA); "
        "--transformer-impl local (Transformer Engine is not installed); "
        "--no-persist-layer-norm (no CUDA); --no-gradient-accumulation-fusion (no CUDA); "
        "--no-bias-gelu-fusion (no CUDA); --no-bias-swiglu-fusion (no CUDA); "
        "--no-bias-dropout-fusion (no CUDA); --no-masked-softmax-fusion (no CUDA); "
        "--no-rope-fusion (no CUDA)"]
    assert (args.distributed_backend, args.transformer_impl) == ("gloo", "local")


def test_ranks_sharing_a_gpu_use_gloo_and_device_zero(parse_args, monkeypatch, capsys):
    """Rank 1 of 2 on one GPU: gloo, device cuda:0; only rank 0 prints the line."""
    args = _parse(parse_args, monkeypatch, gpus=1, installed=(TE, *APEX), ranks=2, rank=1)
    assert (args.distributed_backend, args.local_rank) == ("gloo", 0)
    assert _line(capsys) == []
    _parse(parse_args, monkeypatch, gpus=1, installed=(TE, *APEX), ranks=2, rank=0)
    assert _line(capsys) == [
        "dhelix: adapted to this machine: --distributed-backend gloo, rank devices "
        "cuda:(local rank mod 1) (2 ranks on 1 GPU(s): NCCL refuses two ranks on one "
        "device)"]


def test_a_gpu_per_rank_keeps_nccl(parse_args, monkeypatch, capsys):
    args = _parse(parse_args, monkeypatch, gpus=2, installed=(TE, *APEX), ranks=2, rank=1)
    assert (args.distributed_backend, args.local_rank) == ("nccl", 1)
