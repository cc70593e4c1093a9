"""Training data: Megatron's mock GPT dataset (default) or a bytewise text file, served in
Megatron's pretraining-sampler order.

Order guarantee (Megatron's `MegatronPretrainingSampler`): global batch b covers samples
[b*G, (b+1)*G); within it, each step of `micro_batch_size * dp` consecutive samples gives
data-parallel rank r the slice [r*mbs, (r+1)*mbs). So any TP/PP layout with the same
global batch sees the same samples per global batch, and resuming at `consumed_samples`
continues the exact sequence.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import (
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from megatron.core.datasets.utils import Split
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer


def build_mock_dataset(vocab_size: int, seq_length: int, num_samples: int, seed: int):
    """Megatron's MockGPTDataset with `num_samples` samples of `seq_length` tokens."""
    tokenizer = NullTokenizer(vocab_size - 1)  # NullTokenizer adds the eod token
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    low_level = MockGPTLowLevelDataset(tokenizer)
    return MockGPTDataset(
        low_level, None, np.arange(len(low_level)), num_samples, Split.train, config
    )


class ByteTextDataset:
    """A UTF-8 text file as bytes (vocab 256, eod 256), cut into seq_length+1 windows.

    Produces the same sample dict as Megatron's GPT datasets.
    """

    def __init__(self, path: str, seq_length: int):
        data = np.frombuffer(open(path, "rb").read(), dtype=np.uint8).astype(np.int64)
        if len(data) < seq_length + 1:
            raise ValueError(f"--data-path {path}: needs at least {seq_length + 1} bytes")
        self.data = data
        self.seq_length = seq_length
        self.windows = (len(data) - 1) // seq_length

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, idx: int) -> dict:
        start = (idx % self.windows) * self.seq_length
        chunk = torch.from_numpy(self.data[start: start + self.seq_length + 1].copy())
        return {
            "tokens": chunk[:-1],
            "labels": chunk[1:],
            # host-side samples, like the tokens they sit beside (moved to the model's
            # device with the batch)
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float, device=chunk.device),
            "position_ids": torch.arange(self.seq_length, dtype=torch.long,
                                         device=chunk.device),
        }


def build_train_dataset(args):
    """The dataset `args` ask for: `--data-path` text file, else Megatron's mock data."""
    total = args.train_iters * args.global_batch_size
    if args.data_path:
        return ByteTextDataset(args.data_path, args.seq_length)
    return build_mock_dataset(args.vocab_size, args.seq_length, max(total, 1), args.seed)


def _collate(samples: list[dict]) -> dict:
    out = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        out[key] = torch.stack([torch.as_tensor(s[key]) for s in samples])
    out["tokens"] = out["tokens"].long()
    out["labels"] = out["labels"].long()
    out["loss_mask"] = out["loss_mask"].float()
    out["position_ids"] = out["position_ids"].long()
    return out


def microbatch_iterator(dataset, micro_batch_size: int, data_parallel_rank: int,
                        data_parallel_size: int, consumed_samples: int = 0) -> Iterator[dict]:
    """Infinite iterator of this DP rank's micro-batches in Megatron's sampler order."""
    step = micro_batch_size * data_parallel_size
    start = consumed_samples
    while True:
        first = start + data_parallel_rank * micro_batch_size
        samples = [dataset[(first + i) % len(dataset)] for i in range(micro_batch_size)]
        yield _collate(samples)
        start += step
