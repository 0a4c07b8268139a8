"""`tinyinfer bench --batch --opts name=value,...` (src/tinyinfer/bench_batch.py apply_options): the A/B switch for
the batched step's options. CPU only: apply_options works on any options object, so a stand-in with a field of
each type checks the parsing; the CUDA engine itself is exercised by the lead's bench runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tinyinfer import InvalidRequestError
from tinyinfer.bench_batch import apply_options, open_engine


def fields():
    return SimpleNamespace(batch_gemv_f16_max=1, graphs=True, gemv_resident_margin=0.05, plan_text="", gemv_pins=[])


def test_each_field_is_parsed_as_its_type():
    o = apply_options(fields(), "batch_gemv_f16_max=8,graphs=0,gemv_resident_margin=0.5,plan_text=x")
    assert (o.batch_gemv_f16_max, o.graphs, o.gemv_resident_margin, o.plan_text) == (8, False, 0.5, "x")
    assert type(o.batch_gemv_f16_max) is int and type(o.graphs) is bool


def test_empty_spec_changes_nothing():
    assert apply_options(fields(), "") == fields()


@pytest.mark.parametrize("spec, match", [
    ("no_such_field=1", "not name=value with a CudaOptions field"),
    ("batch_gemv_f16_max", "not name=value"),
    ("batch_gemv_f16_max=eight", "batch_gemv_f16_max='eight' is not a int"),
    ("graphs=yes", "graphs='yes' is not a bool"),
    ("gemv_pins=1", "cannot be set from the command line"),
])
def test_bad_specs_are_clear_errors(spec, match):
    with pytest.raises(InvalidRequestError, match=match):
        apply_options(fields(), spec)


def test_opts_need_the_cuda_engine():
    with pytest.raises(InvalidRequestError, match="needs --device cuda"):
        open_engine("cpu", "smollm2-135m", None, "fp32", 64, 2, opts_spec="batch_gemv_f16_max=8")
