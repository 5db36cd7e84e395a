"""Arithmetic probes: clean runs pass with the derived tolerance; a corrupted
matmul or reduction (a real bit flip in its result) fails; results are events."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch

from resilient.events import EventLog
from resilient.sdc.api import SdcConfig
from resilient.sdc.inject import flip_bit
from resilient.sdc.probes import Prober, fp32_sum, matmul_probe, reduction_probe

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clean_probes_pass(device, dtype, seed):
    for n in (17, 128):
        r = matmul_probe(dtype, device, n=n, seed=seed)
        assert r.ok, r
    r = reduction_probe(dtype, device, n=1 << 16, seed=seed)
    assert r.ok and r.max_err == 0.0, r


def _corrupt_matmul(bit: int, element: int = 77):
    def mm(a, b):
        c = torch.matmul(a, b)
        flip_bit(c, element, bit)
        return c
    return mm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,bits", [(torch.float32, [31, 30, 23, 22, 15]), (torch.bfloat16, [15, 14, 7, 6, 4])])
def test_corrupted_matmul_is_caught(device, dtype, bits):
    for bit in bits:
        r = matmul_probe(dtype, device, n=64, seed=3, matmul=_corrupt_matmul(bit))
        assert not r.ok and r.worst_index == 77, (bit, r)


def test_lowest_fp32_bits_of_a_matmul_are_within_rounding():
    # below the derived tolerance by construction: a 1-ulp change is what rounding does
    r = matmul_probe(torch.float32, "cpu", n=64, seed=3, matmul=_corrupt_matmul(0))
    assert r.ok


@pytest.mark.parametrize("bit", [0, 5, 20, 31])
def test_corrupted_reduction_is_caught_down_to_the_lowest_bit(bit):
    def bad_sum(x):
        s = fp32_sum(x)
        flip_bit(s.reshape(1), 0, bit) if s.item() != 0 else None
        return s
    r = reduction_probe(torch.float32, "cpu", n=1 << 14, seed=5, reduce=bad_sum)
    assert not r.ok, r


def test_prober_emits_events_and_runs_in_background(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", rank=0)
    cfg = SdcConfig(probe_matmul=32, probe_reduce=1 << 12)
    p = Prober.from_config(cfg, "cpu", events=log)
    assert all(r.ok for r in p.run_once("test"))
    p.start(timedelta(milliseconds=20))
    try:
        import time
        deadline = time.monotonic() + 10
        while len(p.results) < 12 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        p.stop(timedelta(seconds=10))
    assert len(p.results) >= 12 and not p.failed
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert {e["event"] for e in events} == {"sdc_probe"}
    assert {e["reason"] for e in events} == {"test", "periodic"}
    assert {(e["probe"], e["dtype"]) for e in events} == {("matmul", "float32"), ("sum", "float32"),
                                                           ("matmul", "bfloat16"), ("sum", "bfloat16")}


def test_faulty_prober_lists_failures():
    p = Prober("cpu", dtypes=("float32",), matmul_n=32, reduce_n=1024, matmul=_corrupt_matmul(30, element=5))
    res = p.run_once()
    assert [r.probe for r in p.failed] == ["matmul"] and len(res) == 2


def test_a_probe_that_raises_is_a_failed_probe():
    def broken(a, b):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    p = Prober("cpu", dtypes=("float32",), matmul_n=16, reduce_n=256, matmul=broken)
    res = {r.probe: r for r in p.run_once()}
    assert not res["matmul"].ok and "illegal memory access" in res["matmul"].error and res["sum"].ok
