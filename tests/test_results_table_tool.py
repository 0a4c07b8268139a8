"""bench/tools/results_table.py: the README's decode rows and the targets' line from bench JSON files (synthetic
here; the GPU's own files are the tool's input in use)."""

from __future__ import annotations

import json

from conftest import load_script


def _bench(tmp_path, name: str, model: str, dtype: str, decode: list, **extra) -> str:
    d = {"model": model, "dtype": dtype, "read_bandwidth_gb_s": 4600.4, "decode": decode,
         "prefill": [{"tokens": 512, "ms": 2.5, "tok_s": 204800.0}], **extra}
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return str(path)


def test_rows_and_targets(tmp_path):
    mod = load_script("bench/tools/results_table.py")
    dec = [{"context": 16, "tok_s": 1612.4, "pct_roofline": 73.9},
           {"context": 4096, "tok_s": 1300.0, "pct_roofline": 60.0}]
    a = _bench(tmp_path, "a.json", "tinyllama-1.1b", "fp16", dec, early_trigger=2, smem_carveout=-1)
    b = _bench(tmp_path, "b.json", "llama2-7b", "int4", [{"context": 16, "tok_s": 425.0, "pct_roofline": 40.0}],
               smem_carveout=50)
    (tmp_path / "batch.json").write_text(json.dumps({"batch": []}))  # not a decode bench: skipped
    table, notes = mod.rows([a, b, str(tmp_path / "batch.json")])
    assert table == [
        "| TinyLlama-1.1B | fp16 | 1,612 (73.9%) | — | 1,300 (60.0%) | 2.50 ms (205k tok/s) | `a.json` |",
        "| Llama-2-7B | int4 | 425 (40.0%) | — | — | 2.50 ms (205k tok/s) | `b.json` |",
    ]
    assert notes[0] == ("a.json: read bandwidth 4,600 GB/s; early triggers GEMVs + attention, carveout driver; "
                        "target ctx 16: 1,612 / 1,550 (met), ctx 4096: 1,300 / 1,400 (93%)")
    assert notes[1] == ("b.json: read bandwidth 4,600 GB/s; early triggers not recorded, carveout 50%; "
                        "target ctx 16: 425 / 850 (50%)")
