"""_core.ops.restrict_to_sms (cuda/sm_partition.cu): a process held to part of the GPU's SMs (a green context), the
benchmarks' way to ask each SM of an H100 for an H200's bytes per second. Each case runs in a process of its own:
the partition holds for the rest of the process that made it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tinyinfer import InvalidRequestError, _core

gpu = pytest.mark.gpu
cuda_build = pytest.mark.skipif(not _core.build_info["cuda"], reason="tinyinfer built without CUDA")

# A SmolLM2-135M-shaped random engine: the prompt's logits and 8 greedy decode steps, as JSON.
SCRIPT = """
import json, sys
import numpy as np
from tinyinfer import _core
from tinyinfer.bench import shape_config
n = int(sys.argv[1])
part = _core.ops.restrict_to_sms(n) if n else None
e = _core.CudaEngine.random(shape_config("smollm2-135m"), 256, 1)
logits = e.forward(list(range(1, 12)), True)
tokens = e.decode(8, _core.SamplingConfig(), [], 0)
print(json.dumps({"part": part, "logits": np.asarray(logits)[:, :4096].tolist(), "tokens": list(tokens)}))
"""


def run(sms: int) -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(sms)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@cuda_build
def test_restrict_to_sms_refuses_a_count_below_one():
    with pytest.raises(InvalidRequestError, match="sms must be >= 1, got 0"):
        _core.ops.restrict_to_sms(0)


@gpu
def test_restrict_to_sms_refuses_more_sms_than_the_device_has():
    r = subprocess.run([sys.executable, "-c", "from tinyinfer import _core; _core.ops.restrict_to_sms(100000)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "100000 SMs asked, the device has" in r.stderr


@gpu
def test_an_engine_on_part_of_the_gpu_computes_what_it_computes_on_all_of_it():
    whole, held = run(0), run(16)
    p = held["part"]
    assert 16 <= p["sms"] < p["device_sms"] and p["sms"] % max(1, p["alignment"]) == 0, p
    a, b = np.array(whole["logits"]), np.array(held["logits"])
    assert np.abs(a - b).max() <= 1e-3 * np.abs(a).max()
    assert held["tokens"] == whole["tokens"]
