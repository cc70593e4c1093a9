"""Megatron's data and checkpoints under the plugin, on 4 real gloo ranks with TP2 x PP2 (the
folded model under --dhelix): a text corpus made here is turned into an indexed dataset
(.bin/.idx) with megatron-core's tokenizer and `IndexedDatasetBuilder` and trained from with
`--data-path`, stock and --dhelix giving the same losses; and checkpoints saved with and
without --dhelix load into each other through Megatron's own --save/--load: a 6-step run done
as stock (save) -> --dhelix (load, save) -> stock (load) has the losses and parameters of the
uninterrupted stock run. A stock checkpoint saved with dropout 0.1 and resumed with
`--use-checkpoint-args --dhelix` is refused in seconds, before any model is built, with one
`error:` line naming the checkpoint and the argument."""

import pytest

from dhelix.harness import run_on_ranks
from tests.megatron_lm_ranks import data_and_checkpoint_body, write_indexed_corpus

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
FP32_LOSS = 2e-6
FP32_PARAM = 1e-6


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mlm")
    prefix = write_indexed_corpus(workdir / "corpus_text_document")
    result = run_on_ranks(data_and_checkpoint_body, 4, str(workdir), prefix, TP2_PP2,
                          timeout_s=600, env={"OMP_NUM_THREADS": "1"})[0]
    print(f"indexed data, stock vs --dhelix (loss, diff): {result['data']}")
    print(f"uninterrupted stock: {result['reference']}")
    print(f"stock -> --dhelix -> stock via --save/--load: {result['chain']}")
    print(f"parameter diff at the hand-overs (steps 3 and 5): {result['handover_param_diff']}")
    print(f"--use-checkpoint-args --dhelix refusal: {result['checkpoint_args_refusal']}")
    return result


def test_indexed_dataset_trains_with_and_without_dhelix(report):
    assert report["data_steps"] == (2, 2)
    for loss, diff in report["data"]:
        assert 0 < loss < 10 and diff <= FP32_LOSS


def test_checkpoints_load_into_each_other(report):
    assert len(report["chain"]) == len(report["reference"]) == 6
    for got, want in zip(report["chain"], report["reference"]):
        assert abs(got - want) <= FP32_LOSS
    assert max(report["handover_param_diff"]) <= FP32_PARAM


def test_checkpoint_args_are_checked_once_loaded(report):
    """The command line says dropout 0; --use-checkpoint-args takes the checkpoint's 0.1: the
    --dhelix check runs on the loaded value (megatron_patches.run_options), right after
    Megatron's parse_and_validate_args loaded it, before initialize_megatron and the model."""
    refusal = report["checkpoint_args_refusal"]
    assert refusal["code"] == 2, refusal
    errors = [line for line in refusal["stderr"] if line.startswith("error:")]
    assert len(errors) == 1 and refusal["stderr"][-1] == errors[0], refusal["stderr"]
    line = errors[0]
    assert f"--load {refusal['checkpoint']} (--use-checkpoint-args) sets" in line, line
    assert "--hidden-dropout 0.1" in line and "--dhelix needs --hidden-dropout 0" in line, line
    # parsing and reading the checkpoint's arguments only: no model, optimizer or data
    assert refusal["seconds"] < 15, refusal
