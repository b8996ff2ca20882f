"""``python -m vllm_nvfp4_sm120.bench host [--cold]``: its arguments; timings only on a GPU (no timed tests)."""

import pytest
import torch

from vllm_nvfp4_sm120 import bench, bench_host


def test_parser_has_host_and_cold():
    args = bench.build_parser().parse_args(["host", "--cold", "--sizes", "1,8", "--json", "x.json"])
    assert args.func is bench_host.run and args.cold and args.sizes == "1,8" and args.json == "x.json"
    assert args.jobs == bench_host.COLD_JOBS > 1  # the parallel phase runs by default
    assert args.timeout + bench_host.WARM_TIMEOUT_S + bench_host.PARALLEL_TIMEOUT_S <= 210


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_gpu_says_so(capsys):
    assert bench.main(["host"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

