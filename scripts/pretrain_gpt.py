#!/usr/bin/env python
"""GPT pretraining through Megatron-LM's own training loop, `megatron.training.pretrain`.

A thin example entry point in the shape of Megatron-LM's `pretrain_gpt.py` (megatron-core
0.19): Megatron parses and validates the arguments, the model is Megatron's GPTModel built
from `gpt_config_from_args`, the data is Megatron's `GPTDataset` over `--data-path` prefixes
of indexed datasets (.bin/.idx) or `MockGPTDataset` with `--mock-data`, and `pretrain()` does
the rest (LR schedule, logging, evaluation, checkpointing). dhelix is not imported here: run
the script under `dhelix.megatron_lm` to train on CPU/gloo and to switch `--dhelix` in:

    torchrun --nproc-per-node 4 -m dhelix.megatron_lm scripts/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 \
        --train-iters 10 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer \
        --vocab-size 1024 [--dhelix]

Left out against Megatron-LM's script: SFT, FIM, packed sequences, ModelOpt and
distillation. `--tokenizer-type` defaults to NullTokenizer (Megatron's default GPT-2 BPE
needs vocabulary files).
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator):
    """This rank's micro-batch: TP rank 0 reads it and broadcasts it to its TP group; stages
    that neither embed nor compute the loss get Nones."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(None):
        return dict.fromkeys(BATCH_KEYS)
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        batch = {k: (batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None)
                 for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        mtp_on_this_rank=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                     cp_group=mpu.get_context_parallel_group())


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed token loss of one micro-batch, its token count, and the 'lm loss' report
    (Megatron's 3-tuple: the schedule and the training loop divide by the token count)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        rerun = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                  message=f"found {what} in local forward loss calculation")
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One micro-batch through this stage's model chunk; returns (output, loss function)."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def is_dataset_built_on_rank():
    """Only TP rank 0 of the stages that read data builds the datasets."""
    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(None)


def gpt_dataset_config(args) -> GPTDatasetConfig:
    """Megatron's GPT dataset config from the parsed arguments."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Train, validation and test datasets: MockGPTDataset with --mock-data, else GPTDataset
    over the --data-path indexed datasets."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, is_dataset_built_on_rank,
        gpt_dataset_config(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


def main() -> None:
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
             forward_step)


if __name__ == "__main__":
    main()
