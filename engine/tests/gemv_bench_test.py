"""engine.gemv_bench on a machine without CUDA: the shapes it streams, and a clear refusal."""

from engine import gemv_bench
from engine.config import ModelConfig


def test_matrix_shapes_of_llama3_8b():
    shapes = gemv_bench.matrix_shapes(ModelConfig.preset("llama3-8b"))
    assert shapes == {
        "qkv_proj": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up_proj": (28672, 4096),
        "down_proj": (4096, 14336),
        "lm_head": (128256, 4096),
    }


def test_refuses_without_cuda_by_name(capsys):
    assert gemv_bench.main(["--model", "tiny"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
