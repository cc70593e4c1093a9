"""`dhelix ops`: the operator table and DAG export for a model/parallel configuration."""

from __future__ import annotations

import json

from dhelix.cli import main
from dhelix.dag import load_dag
from tests.megatron_lm_ranks import TINY

# the tiny preset, expanded to Megatron arguments as for `dhelix train`; dropout 0 (the
# operator programs' setting; Megatron's default is 0.1)
PRESET = ["--preset", "tiny", "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_ops_table_and_dag_export(tmp_path, capsys):
    argv = ["ops", *PRESET, "--tensor-model-parallel-size", "4",
            "--sequence-parallel", "--ranks-per-node", "2", "--export-dag", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "forward program: 14 operators" in out
    assert "backward program: 20 operators" in out
    assert "all_gather(shape=64x2x128)/float32/g4/inter" in out
    assert "saved for backward:" in out
    fwd, bwd = load_dag(tmp_path / "fwd.json"), load_dag(tmp_path / "bwd.json")
    assert (len(fwd.ops), len(bwd.ops)) == (14, 20)
    assert fwd.direction == "fwd" and bwd.direction == "bwd"


def test_ops_json_and_channel_of_one_node(capsys, monkeypatch):
    monkeypatch.delenv("DHELIX_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    # Megatron's own arguments, as a pretrain_gpt.py command line gives them
    assert main(["ops", *TINY, "--tensor-model-parallel-size", "2",
                 "--direction", "bwd", "--json"]) == 0
    dags = json.loads(capsys.readouterr().out)
    assert list(dags) == ["bwd"]
    comm = [op for op in dags["bwd"]["ops"] if op["kind"] == "comm"]
    assert [op["op_class"] for op in comm] == ["all_reduce", "all_reduce"]
    assert {op["channel"] for op in comm} == {"intra"}


def test_ops_rejects_unsupported_configs(capsys):
    assert main(["ops", *PRESET, "--hidden-dropout", "0.1"]) == 2
    assert "dropout 0 only" in capsys.readouterr().err
    assert main(["ops", *PRESET, "--tensor-model-parallel-size", "3"]) == 2
    assert "must be a multiple of tensor_model_parallel_size (3)" in capsys.readouterr().err
    assert main(["ops", *PRESET, "--no-such-argument"]) == 2  # Megatron's parser, one line
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unrecognized arguments: --no-such-argument")
    assert "\n" not in err


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
       "alltoall", "--expert-model-parallel-size", "2", "--moe-layer-freq", "[1,0,1,0]",
       "--world-size", "2", "--ranks-per-node", "1"]


def test_ops_lists_the_moe_operators_of_a_mixed_stack(tmp_path, capsys):
    assert main(["ops", *PRESET, *MOE, "--export-dag", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stack: MoE layers [0, 2], dense layers [1, 3]" in out
    assert "forward program: 18 operators" in out and "backward program: 29 operators" in out
    for op_id in ("router", "counts.ag", "dispatch.a2a", "experts.fc1", "combine.a2a",
                  "experts.fc1.wgrad.0", "experts.join", "dispatch.a2a_grad"):
        assert f"\n{op_id} " in out, op_id
    # EP=2 with one rank per node: the all-to-alls cross nodes
    assert "all_to_all(rows=256,h=128)/float32/g2/inter" in out
    assert "dispatch.splits (run-time metadata)" in out
    assert "planned layer pair by layer pair at --dhelix start-up" in out
    assert len(load_dag(tmp_path / "bwd.json").ops) == 29
    assert main(["ops", *PRESET, *MOE, "--layer", "1", "--direction", "fwd"]) == 0
    out = capsys.readouterr().out
    assert "forward program: 10 operators" in out and "\nfc1 " in out
