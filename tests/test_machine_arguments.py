"""The arguments the plugin adapts to the machine (`megatron_patches.machine_arguments`),
through the plugin's own hook on Megatron's real `parse_args`, with CUDA and the optional
packages (Transformer Engine, NVIDIA Apex and its CUDA extensions) faked present or
missing: each machine gets exactly the adaptations its missing parts require, and rank 0
prints one line naming them; more ranks on a node than GPUs are refused in one `error:`
line before any process group exists."""

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


REFUSAL = ("error: more ranks on this node (4) than GPUs (1): NCCL refuses two ranks on one "
           "GPU and gloo cannot carry Megatron's gradient all-reduce of CUDA tensors; start "
           "at most 1 rank(s) per node (torchrun --nproc-per-node 1), or hide the GPUs "
           "(CUDA_VISIBLE_DEVICES=) to train on the CPU")


@pytest.mark.parametrize("backend", [[], ["--distributed-backend", "gloo"]],
                         ids=["nccl", "gloo"])
def test_more_ranks_than_gpus_is_refused_in_one_line(parse_args, monkeypatch, capsys,
                                                     backend):
    """4 ranks on 1 GPU stop in the argument hook (exit code 2, no process group), with
    either backend: rank 0 prints the one `error:` line, the other ranks stop silently."""
    for name in ("DHELIX_ERROR_FILE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    for rank, expected in ((0, [REFUSAL]), (3, [])):
        with pytest.raises(SystemExit) as stopped:
            _parse(parse_args, monkeypatch, gpus=1, installed=(TE, *APEX), ranks=4,
                   rank=rank, argv=ARGV + backend)
        assert stopped.value.code == 2
        out, err = capsys.readouterr()
        assert [l for l in err.splitlines() if l.startswith("error:")] == expected
        assert "dhelix: adapted" not in out
        assert not torch.distributed.is_initialized()


def test_ranks_without_cuda_are_not_refused(parse_args, monkeypatch):
    """Without CUDA (e.g. CUDA_VISIBLE_DEVICES=) the same 4 ranks parse, over gloo."""
    args = _parse(parse_args, monkeypatch, gpus=0, ranks=4, rank=3)
    assert args.distributed_backend == "gloo"


def test_a_gpu_per_rank_keeps_nccl(parse_args, monkeypatch, capsys):
    """2 ranks on 2 GPUs: nothing to adapt, rank 1 keeps its own device cuda:1 (Megatron
    calls `torch.cuda.set_device(args.local_rank)`)."""
    args = _parse(parse_args, monkeypatch, gpus=2, installed=(TE, *APEX), ranks=2, rank=1)
    assert (args.distributed_backend, args.local_rank) == ("nccl", 1)
    assert _line(capsys) == []


def test_field_docstrings_are_read_once_and_equal_megatrons(parse_args, monkeypatch):
    """The hooked parser reads each config class's source once per process
    (`megatron_patches.argument_docstrings`): a second parse reads no source, and every
    help text and parsed value equals what Megatron's own reader gives."""
    import argparse
    import inspect

    from megatron.training.argument_utils import ArgumentGroupFactory
    from megatron.training.arguments import add_megatron_arguments

    first = vars(_parse(parse_args, monkeypatch, gpus=0))
    reads = []
    getsource = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: reads.append(obj) or getsource(obj))
    assert vars(_parse(parse_args, monkeypatch, gpus=0)) == first
    assert reads == []
    cached = ArgumentGroupFactory._get_field_docstrings
    monkeypatch.setattr(ArgumentGroupFactory, "_get_field_docstrings",
                        cached.__dhelix_original__)

    def helps(parser):
        return {a.dest: a.help for a in parser._actions}

    uncached = helps(add_megatron_arguments(argparse.ArgumentParser()))
    assert len(reads) > 0  # Megatron's reader really ran
    monkeypatch.setattr(ArgumentGroupFactory, "_get_field_docstrings", cached)
    assert helps(add_megatron_arguments(argparse.ArgumentParser())) == uncached
