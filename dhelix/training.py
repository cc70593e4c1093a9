"""A Megatron-core training loop: GPTModel in Megatron DDP, Megatron's optimizer and
Megatron's own forward/backward schedule (written when megatron-core 0.16 shipped no
`megatron.training`).

`Trainer` owns the model chunks, the optimizer and the data iterator of one rank. The
forward/backward function is a field: with `--dhelix` it is the DHelix schedule
(`dhelix.runtime`), which has Megatron's signature, and nothing else changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection

from dhelix.data import build_train_dataset, microbatch_iterator
from dhelix.devices import compute_device
from dhelix.folding import uses_folded_model
from dhelix.memory import peak_memory_bytes
from dhelix.parallel import Job
from megatron_patches.folded_model import FoldedGPTModel, build_folded_model_chunks
from megatron_patches.model_provider import build_model_chunks
from megatron_patches.optimizer_state import make_optimizer_state_loadable


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch (Megatron's 2-tuple convention: the schedule
    divides by the number of micro-batches)."""
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """Megatron forward_step: one micro-batch through this stage's model chunk."""
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    output = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
    )
    return output, partial(loss_func, batch["loss_mask"])


@dataclass
class StepResult:
    iteration: int
    loss: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: int
    forward_backward_s: float = 0.0  # the part of step_time_s before the optimizer step


@dataclass
class Trainer:
    """One rank's model, optimizer and data; `train_step` runs one global batch.

    Build with `Trainer.build(args, job)` after the process group and Megatron's parallel
    state exist (`dhelix.parallel`).
    """

    args: object
    config: object
    model: list
    optimizer: object
    dataset: object
    consumed_samples: int = 0
    iteration: int = 0
    forward_backward_func: Callable = field(default=None)
    dhelix: object = None  # dhelix.runtime.setup.DHelixSetup when --dhelix
    _data_iterator: object = None

    @classmethod
    def build(cls, args, job: Job, model_builder: Callable | None = None,
              lane_pool=None) -> "Trainer":
        """`job`: this process's `dhelix.parallel.Job` (its timeout goes to the `--dhelix`
        lane groups). `lane_pool` (a `dhelix.runtime.lanes.LanePool`, default None): lane
        groups to reuse, for several trainers in one process. `model_builder(args) ->
        (config, [chunks])` builds this rank's model chunks.
        Default: the folded model (`megatron_patches.folded_model.build_folded_model_chunks`)
        when `--dhelix` runs with PP > 1 (`dhelix.folding.uses_folded_model`; Megatron's
        parallel state must then be initialised with `folded=True`), else stock GPTModel."""
        if model_builder is None:
            model_builder = (build_folded_model_chunks if uses_folded_model(args)
                             else build_model_chunks)
        config, chunks = model_builder(args)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.bf16,
            overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        model = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
            for chunk in chunks
        ]
        for chunk in model:
            chunk.broadcast_params()
        opt_config = OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(opt_config, model)
        make_optimizer_state_loadable(optimizer)
        # Bound to the groups of this trainer's parallel state (the folded model's embedding
        # group differs from stock Megatron's), so two trainers can share a process.
        config.finalize_model_grads_func = partial(
            finalize_model_grads,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(
                ["tp", "pp", "embd", "pos_embd", "dp_cp"]))
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = [chunk.no_sync for chunk in model]
        if len(model) == 1:
            config.no_sync_func = config.no_sync_func[0]
        trainer = cls(args=args, config=config, model=model, optimizer=optimizer,
                      dataset=build_train_dataset(args))
        trainer.forward_backward_func = get_forward_backward_func()
        if getattr(args, "dhelix", False):
            from dhelix.arguments import trainer_run
            from dhelix.runtime.setup import setup_dhelix

            trainer.dhelix = setup_dhelix(trainer_run(args), model, job, lane_pool=lane_pool)
            trainer.forward_backward_func = trainer.dhelix.forward_backward_func
        return trainer

    @property
    def loss_on_first_stage(self) -> bool:
        """True for the folded model, whose loss is computed on the first pipeline stage."""
        return isinstance(getattr(self.model[0], "module", self.model[0]), FoldedGPTModel)

    def data_iterator(self):
        """This rank's micro-batch iterator, positioned at `consumed_samples`."""
        if self._data_iterator is None:
            self._data_iterator = microbatch_iterator(
                self.dataset,
                self.args.micro_batch_size,
                parallel_state.get_data_parallel_rank(),
                parallel_state.get_data_parallel_world_size(),
                self.consumed_samples,
            )
        return self._data_iterator

    def reset_data_iterator(self) -> None:
        """Forget the iterator so the next one starts at `consumed_samples` (after a load)."""
        self._data_iterator = None

    def forward_backward(self) -> list:
        """Zero grads and run the schedule for one global batch; grads are finalised
        (DP/TP/embedding reductions) by the schedule's `finalize_model_grads` call."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        return self.forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=self.data_iterator(),
            model=self.model,
            num_microbatches=self.args.num_microbatches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=False,
        )

    def optimizer_step(self) -> float:
        """Apply the optimizer to the finalised grads, then advance `iteration` and
        `consumed_samples`. Returns the grad norm (nan when the optimizer reports none)."""
        _, grad_norm, _ = self.optimizer.step()
        self.iteration += 1
        self.consumed_samples += self.args.global_batch_size
        return float(grad_norm) if grad_norm is not None else float("nan")

    def train_step(self) -> StepResult:
        """One iteration: forward/backward over the global batch, then the optimizer step."""
        start = time.perf_counter()
        losses = self.forward_backward()
        forward_backward_s = time.perf_counter() - start
        grad_norm = self.optimizer_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        tokens = self.args.global_batch_size * self.args.seq_length
        return StepResult(
            iteration=self.iteration,
            loss=reduce_loss_to_all_ranks(losses, self.loss_on_first_stage),
            grad_norm=grad_norm,
            step_time_s=elapsed,
            tokens_per_s=tokens / elapsed,
            peak_memory_bytes=peak_memory_bytes(),
            forward_backward_s=forward_backward_s,
        )


def reduce_loss_to_all_ranks(losses_reduced: list, loss_on_first_stage: bool = False) -> float:
    """Mean 'lm loss' of the global batch, known on every rank.

    Megatron's schedule returns the per-micro-batch dicts on the last pipeline stage only
    (on the first stage for a folded model: `loss_on_first_stage=True`); they are averaged
    over micro-batches, then over data-parallel ranks, and one rank (that stage, TP rank 0,
    DP rank 0) contributes the result to a world all-reduce.
    """
    value = torch.zeros(1, dtype=torch.float64, device=compute_device())
    has_loss = (parallel_state.is_pipeline_first_stage() if loss_on_first_stage
                else parallel_state.is_pipeline_last_stage())
    if has_loss:
        mean = torch.stack([d["lm loss"].double().reshape(()) for d in losses_reduced]).mean()
        mean = mean.reshape(1)
        dist.all_reduce(mean, group=parallel_state.get_data_parallel_group())
        mean /= parallel_state.get_data_parallel_world_size()
        if (parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0):
            value = mean
    if torch.cuda.is_available():
        value = value.cuda()
    dist.all_reduce(value)
    return float(value.item())
