"""The GPU engine (fp16) against the CPU reference engine (fp32) on random models, and against transformers
on CUDA at the TinyLlama-1.1B shape. Skipped without a usable CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import GPU_MEMORY_SLACK, gpu_free_bytes, make_llama
from tinyinfer import Engine

pytestmark = pytest.mark.gpu

CONFIGS = {
    "gqa3_hd64": dict(hidden=384, heads=6, kv_heads=2, head_dim=64, intermediate=1000, layers=3),
    "gqa4_hd128_tied": dict(hidden=512, heads=8, kv_heads=2, head_dim=128, tie=True, layers=2),
    "gqa1_hd96_i300": dict(hidden=192, heads=4, kv_heads=4, head_dim=96, intermediate=300, layers=2),
    "gqa8_hd64_llama3": dict(hidden=512, heads=16, kv_heads=2, head_dim=64, layers=2, rope_theta=500000.0,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=32)),
    "gqa7_hd256": dict(hidden=448, heads=7, kv_heads=1, head_dim=256, layers=2),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engines(request, tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp(request.param), vocab=1000, **CONFIGS[request.param])
    return request.param, Engine(d, device="cuda", max_seq_len=300), Engine(d, device="cpu", max_seq_len=300)


def test_gpu_logits_match_cpu(engines):
    name, gpu, cpu = engines
    ids = np.random.default_rng(0).integers(3, 1000, 150).tolist()  # crosses two 64-position chunks
    g, c = gpu.logits(ids), cpu.logits(ids)
    rel = np.abs(g - c).max() / np.abs(c).max()
    agree = (g.argmax(-1) == c.argmax(-1)).mean()
    print(f"{name}: max rel logit error {rel:.2e}, top-1 agreement {agree:.3f}")
    assert np.isfinite(g).all()
    assert rel < 2e-2
    assert agree >= 0.95


def test_gpu_greedy_tokens_are_cpu_argmax(engines):
    """Teacher-forced: each token the GPU picks greedily is the CPU's argmax, or within fp16 noise of it."""
    name, gpu, cpu = engines
    prompt = [5, 17, 400, 23, 99, 7]
    out = gpu.generate(prompt, max_tokens=40, ignore_eos=True)
    assert len(out.token_ids) == 40
    ref = cpu.logits(prompt + out.token_ids[:-1])[len(prompt) - 1 :]
    scale = np.abs(ref).max()
    picked = ref[np.arange(40), out.token_ids]
    assert np.all(picked >= ref.max(-1) - 2e-2 * scale)
    exact = int(np.argmax(np.r_[np.array(out.token_ids) != ref.argmax(-1), True]))
    print(f"{name}: greedy tokens identical to CPU argmax for the first {exact} of 40")


def test_gpu_sampling_seed_reproduces_and_chunks_continue(engines):
    _, gpu, _ = engines
    kw = dict(max_tokens=70, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    a = gpu.generate([5, 6, 7], **kw).token_ids
    b = gpu.generate([5, 6, 7], **kw).token_ids
    assert a == b and len(a) == 70
    assert gpu.generate([5, 6, 7], **{**kw, "seed": 4}).token_ids != a


def test_gpu_prompt_in_chunks_gives_the_one_pass_tokens(engines):
    """The single path prefills a prompt in calls of _prefill_chunk tokens (the CPU's way to let a Ctrl-C in; one
    call on the GPU): calls of 37 tokens, each at the cache position the last left, pick the CPU's greedy tokens
    (within fp16 noise, as above)."""
    _, gpu, cpu = engines
    prompt = np.random.default_rng(1).integers(3, 1000, 150).tolist()
    calls, core, chunk = [], gpu._core, gpu._prefill_chunk

    class Spy:
        def forward(self, ids, all_logits=False):
            calls.append(len(ids))
            return core.forward(ids, all_logits=all_logits)

        def __getattr__(self, name):
            return getattr(core, name)

    try:
        gpu._core, gpu._prefill_chunk = Spy(), 37
        out = gpu.generate(prompt, max_tokens=12, ignore_eos=True).token_ids
    finally:
        gpu._core, gpu._prefill_chunk = core, chunk
    assert calls == [37, 37, 37, 37, 2]
    ref = cpu.logits(prompt + out[:-1])[len(prompt) - 1:]
    picked = ref[np.arange(12), out]
    assert np.all(picked >= ref.max(-1) - 2e-2 * np.abs(ref).max())


def test_gpu_next_turn_reuses_the_cache(engines):
    """A prompt that extends the last prompt and its answer prefills only its new tokens (the answer's last token,
    sampled but not fed, first) and picks the CPU's greedy tokens over the whole sequence (within fp16 noise)."""
    _, gpu, cpu = engines
    first = [5, 17, 400, 23]
    a = gpu.generate(first, max_tokens=9, ignore_eos=True).token_ids
    turn = first + a + [31, 32, 33]
    out = gpu.generate(turn, max_tokens=10, ignore_eos=True)
    assert out.stats.cached_tokens == len(first) + len(a)
    ref = cpu.logits(turn + out.token_ids[:-1])[len(turn) - 1:]
    picked = ref[np.arange(10), out.token_ids]
    assert np.all(picked >= ref.max(-1) - 2e-2 * np.abs(ref).max())


def test_gpu_stop_ids_and_top_k_1(engines):
    _, gpu, _ = engines
    greedy = gpu.generate([9, 8, 7], max_tokens=20, ignore_eos=True).token_ids
    assert gpu.generate([9, 8, 7], max_tokens=20, temperature=1.3, top_k=1, seed=1, ignore_eos=True).token_ids == greedy
    stop = greedy[5]
    out = gpu.generate([9, 8, 7], max_tokens=20, stop_token_ids=[stop], ignore_eos=True)
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(stop) + 1]


def test_gpu_engine_refuses_bad_requests_and_stays_usable(engines):
    from tinyinfer import InvalidRequestError

    _, gpu, _ = engines
    want = gpu.generate([1, 2, 3], max_tokens=5, ignore_eos=True).token_ids
    with pytest.raises(InvalidRequestError, match=r"max_tokens \(400\) exceeds max_seq_len=300"):
        gpu.generate([1, 2, 3], max_tokens=400)
    with pytest.raises(InvalidRequestError, match="token id 1000000 is out of range for a vocabulary of 1000"):
        gpu.generate([10**6])
    assert gpu.generate([1, 2, 3], max_tokens=5, ignore_eos=True).token_ids == want


def test_tinyllama_shape_vs_transformers_on_cuda(tmp_path):
    import torch


    d = make_llama(tmp_path / "tl", hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, head_dim=64,
                   vocab=32000, dtype="float16", init_std=0.05)
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float16).cuda().eval()
    eng = Engine(d, device="cuda", max_seq_len=512)
    ids = np.random.default_rng(0).integers(3, 32000, 64).tolist()
    ours = eng.logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    agree = (ours.argmax(-1) == ref.argmax(-1)).mean()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    out = eng.generate(ids, max_tokens=32, ignore_eos=True).token_ids
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=32, do_sample=False,
                             min_new_tokens=32)[0, 64:].tolist()
    same = int(np.argmax(np.r_[np.array(out) != np.array(hf_out), True]))
    print(f"TinyLlama shape: top-1 agreement {agree:.3f}, max rel logit diff {rel:.2e}, greedy identical for {same}/32")
    assert agree >= 0.9
    assert rel < 5e-2
    assert same >= 4


def test_verify_reports_gpu_vs_cpu(tmp_path):
    from tinyinfer.bench import verify

    d = make_llama(tmp_path / "v", vocab=1000, **CONFIGS["gqa3_hd64"])
    lines = []
    res = verify(str(d), steps=16, out=lines.append)
    assert res["positions"] == 4 + 15
    assert res["worst_rel_logit_error"] < 2e-2
    assert "worst relative logit error" in lines[0]


def test_long_context_graph_changes_nothing_but_speed(tmp_path):
    """CudaOptions.decode_long_from: from that context on, decode replays a second graph whose qkv GEMV runs at
    one block per SM (the same rows per warp, so the same arithmetic). Greedy and seeded-sampled tokens across the
    switch equal those of an engine with one graph; and the tuned choice (here: on a small model, whatever the
    timing says) is well formed."""
    from tinyinfer import _core

    d = make_llama(tmp_path / "m", vocab=1000, **CONFIGS["gqa3_hd64"])
    engines = []
    for frm in (0, 20, -1):
        o = _core.CudaOptions()
        o.decode_long_from = frm
        engines.append(Engine(d, device="cuda", max_seq_len=400, cuda_options=o))
    one, two, tuned = engines
    assert one._core.decode_long[0] == -1
    assert two._core.decode_long[0] == 20 and two._core.decode_long[2] == 1
    frm, R, bps = tuned._core.decode_long
    assert frm == -1 or (64 <= frm <= 336 and R in (1, 2, 4, 8) and bps in (1, 2)), tuned._core.decode_long
    prompt = [5, 17, 400, 23, 99, 7]
    for kw in (dict(), dict(temperature=0.9, seed=4)):
        want = one.generate(prompt, max_tokens=40, ignore_eos=True, **kw).token_ids
        assert two.generate(prompt, max_tokens=40, ignore_eos=True, **kw).token_ids == want
    assert tuned.generate(prompt, max_tokens=8, ignore_eos=True).token_ids == one.generate(
        prompt, max_tokens=8, ignore_eos=True).token_ids


def test_one_chunk_graph_changes_nothing_but_speed(tmp_path):
    """CudaOptions.one_chunk_graph: steps at positions below one attention chunk replay a graph without the merge
    kernel (which does nothing there). Tokens and logits across the switch at the chunk (64) are bitwise those of
    an engine without it, with graphs and without."""
    from tinyinfer import _core

    d = make_llama(tmp_path / "m", vocab=1000, **CONFIGS["gqa3_hd64"])
    greedy = _core.SamplingConfig()
    runs = []
    for one, graphs in ((False, True), (True, True), (True, False)):
        o = _core.CudaOptions()
        o.one_chunk_graph, o.graphs = one, graphs
        o.gemv_rows, o.gemv_grid, o.decode_long_from = 2, 0, 0  # one GEMV variant each: the same sums in all three
        core = Engine(d, device="cuda", max_seq_len=300, cuda_options=o)._core
        core.forward([5, 17, 400, 23, 99, 7], False)
        runs.append((list(core.decode(90, greedy, [], 0)), core.last_logits()))
    for toks, logits in runs[1:]:
        assert toks == runs[0][0]
        assert np.array_equal(logits, runs[0][1])


# Step options that change only speed: (option, settings as (value, graphs), the timed default's value, the values
# a plan may settle on, the plan's line for a value, values refused).
_SPEED_ONLY = {
    "smem_carveout": (((-1, True), (50, True), (0, True), (100, False), (-2, True)), -2, (-1, 50),
                      "carveout %d", (-3, 101)),
    "early_trigger": (((0, True), (1, True), (2, True), (2, False), (-1, True)), -1, (0, 1, 2), "early %d", (-2, 3)),
}


@pytest.mark.parametrize("option", sorted(_SPEED_ONLY))
def test_step_option_changes_nothing_but_speed_and_bad_values_are_refused(tmp_path, option):
    """CudaOptions.smem_carveout (the decode step's kernels all ask for one shared-memory carveout, a launch
    attribute kept in the graphs, or leave it to the driver) and CudaOptions.early_trigger (its GEMVs but qkv, and
    at 2 its attention too, let their successor launch at their start, or after their wait; 80 steps cross the
    attention's first chunk, so both graphs, with and without the merge kernel, run): tokens and logits are bitwise the same under every
    setting, with graphs and without (what they do to speed is the bench's: docs/perf/decode-options.md); the plan
    says what was used, and the timed default settles on one of the fixed settings; a value outside the range is a
    clear error naming it."""
    from tinyinfer import _core
    from tinyinfer.errors import InvalidRequestError

    settings, timed, settles, line, bad_values = _SPEED_ONLY[option]
    d = make_llama(tmp_path / "m", vocab=1000, **CONFIGS["gqa4_hd128_tied"])
    greedy = _core.SamplingConfig()
    runs = []
    for value, graphs in settings:
        o = _core.CudaOptions()
        setattr(o, option, value)
        o.graphs = graphs
        o.gemv_rows, o.gemv_grid, o.decode_long_from = 2, 0, 0  # one GEMV variant each: the same sums in all
        # (no plan cache: the timed default must time, not read an earlier run's plan)
        core = Engine(d, device="cuda", max_seq_len=300, cuda_options=o, plan_cache=False)._core
        used = int(getattr(core, option))
        assert used == value if value != timed else used in settles
        assert line % used in core.plan_text.splitlines()
        core.forward([5, 17, 400, 23, 99, 7], False)
        runs.append((list(core.decode(80, greedy, [], 0)), core.last_logits()))
    for toks, logits in runs[1:]:
        assert toks == runs[0][0]
        assert np.array_equal(logits, runs[0][1])
    for bad in bad_values:
        o = _core.CudaOptions()
        setattr(o, option, bad)
        with pytest.raises(InvalidRequestError, match=f"{option} must be {timed}"):
            Engine(d, device="cuda", max_seq_len=300, cuda_options=o, plan_cache=False)


def test_engine_leaves_the_callers_options_as_given(tmp_path):
    """Engine(cuda_options=o, dtype=..., act8=...) applies dtype and act8 to its own copy: o is unchanged, so one
    options object can make several engines (as the bench and the tests do) without the first one's dtype leaking
    into the next."""
    import copy

    from tinyinfer import _core

    d = make_llama(tmp_path / "m", hidden=256, intermediate=512, layers=2, vocab=600)  # (int4: multiples of 32)
    o = _core.CudaOptions()
    o.gemv_grid = 1
    c = copy.copy(o)
    c.act8 = 2
    assert (o.act8, c.gemv_grid) == (0, 1)  # a copy, not the same object
    eng = Engine(d, device="cuda", dtype="int4", max_seq_len=64, cuda_options=o, act8=-1, plan_cache=False)
    int4_bytes = eng._core.weight_bytes
    assert (o.weights, o.act8, o.gemv_grid) == (_core.WFormat.fp16, 0, 1)
    eng.close()
    fp16 = Engine(d, device="cuda", max_seq_len=64, cuda_options=o, plan_cache=False)
    assert fp16._core.weight_bytes > 2 * int4_bytes  # the second engine is fp16: the first's int4 did not stay in o


@pytest.mark.parametrize("name", ["gqa3_hd64", "gqa4_hd128_tied"])
def test_attention_tensor_cores_against_the_lane_form(tmp_path, name):
    """CudaOptions.attn_tensor_cores: the decode attention's chunk on mma.sync (head dims 64 / 128) and the
    lane-per-position form both give the CPU engine's logits within fp16 noise, through 150 decode steps (three
    chunks: the merge too); the two differ (fp16 queries and probabilities), so the option reaches the kernel."""
    from tinyinfer import _core

    d = make_llama(tmp_path / "m", vocab=1000, **CONFIGS[name])
    ids = np.random.default_rng(1).integers(3, 1000, 150).tolist()
    ref = Engine(d, device="cpu", max_seq_len=300).logits(ids)[-1]
    scale = np.abs(ref).max()
    out = {}
    for tc in (True, False):
        o = _core.CudaOptions()
        o.attn_tensor_cores, o.batched_prefill = tc, False  # every token through the decode step
        core = Engine(d, device="cuda", max_seq_len=300, cuda_options=o)._core
        core.forward(ids, False)
        out[tc] = np.array(core.last_logits())
        assert np.abs(out[tc] - ref).max() < 2e-2 * scale, tc
    assert np.abs(out[True] - out[False]).max() < 1e-2 * scale
    assert not np.array_equal(out[True], out[False])


def test_out_of_gpu_memory_is_a_clear_error_and_frees_what_it_took():
    """The KV cache cannot fit: refused by name after the 7B weights (12.5 GiB) were allocated, and every byte
    of them given back (device free memory as before, within GPU_MEMORY_SLACK); a real engine fits afterwards."""
    from tinyinfer import DeviceError, _core
    from tinyinfer.bench import shape_config

    cfg = shape_config("llama2-7b")
    cfg.max_position_embeddings = 10**7
    gpu_free_bytes()  # (torch's CUDA context in before any baseline)
    with pytest.raises(DeviceError, match="out of GPU memory.*MiB free"):
        _core.CudaEngine.random(cfg, 2_000_000, 1)  # a 1 TB KV cache
    # the baseline after one failure: what the process keeps of a first engine (the runtime's state) is in
    base = gpu_free_bytes()
    for _ in range(3):  # repeated failures leak nothing
        with pytest.raises(DeviceError, match="out of GPU memory"):
            _core.CudaEngine.random(cfg, 2_000_000, 1)
        held = base - gpu_free_bytes()
        assert held < GPU_MEMORY_SLACK, f"{held / 2**20:.1f} MiB still held after a failed load"
    eng = _core.CudaEngine.random(cfg, 256, 1)
    assert base - gpu_free_bytes() > 12 << 30  # the measurement sees an engine at all (12.5 GiB of weights)
    assert eng.time_decode_step(16, 4) > 0


def test_plan_by_steps_flips_a_role_only_where_the_whole_step_gains():
    """tune_plan_by_steps: each role is tried, one at a time, on its fastest variant alone and on the fastest of
    each other kernel (rows per warp, split-K, the tensor-core product R = 16), each variant once, and kept on the
    one that makes the step faster by more than `gain` (the fastest where several do); a role already on its
    fastest with no other kernel timed is not timed. A variant is (R, blocks per SM, act8): one differing in act8
    alone is another."""
    from tinyinfer import _core

    F, T = False, True
    roles = [
        (8, 2, F, [(8, 2, F, 10.0), (2, 2, F, 9.9)]),                   # the step gains 5% on R2: flipped
        (1, 2, F, [(1, 2, F, 5.0), (1, 2, T, 4.8)]),                    # on int8 inputs it gains 0.4%: kept
        (2, 2, F, [(2, 2, F, 3.0), (1, 0, F, 3.5)]),                    # the fastest, no split-K: never timed
        (8, 2, F, [(8, 2, F, 2.0), (4, 2, F, 2.1), (2, 2, F, 2.2)]),    # split-K fastest; R4 gains 3%
        (1, 2, F, [(1, 2, F, 1.0), (2, 2, F, 0.9), (8, 2, F, 1.2)]),    # R2 gains 2%, split-K 4%: split-K
    ]
    calls = []

    def step_us(chosen):
        calls.append(chosen)
        t = 1000.0
        t -= 50.0 if chosen[0] == (2, 2, F) else 0.0
        t -= 4.0 if chosen[1] == (1, 2, T) else 0.0
        t -= 30.0 if chosen[3] == (4, 2, F) else 0.0
        t -= {(2, 2, F): 20.0, (8, 2, F): 40.0}.get(chosen[4], 0.0)
        return t

    base = [(8, 2, F), (1, 2, F), (2, 2, F), (8, 2, F), (1, 2, F)]

    def at(plan, role, v):
        return plan[:role] + [v] + plan[role + 1:]

    def expected_calls(flips):  # role 0, then role 1 (act8), role 3, role 4 twice; a flip kept where `flips`
        s1 = at(base, 0, (2, 2, F) if flips else (8, 2, F))
        s3 = at(s1, 3, (4, 2, F) if flips else (8, 2, F))
        return [base, at(base, 0, (2, 2, F)), at(s1, 1, (1, 2, T)), at(s1, 3, (4, 2, F)), at(s3, 4, (2, 2, F)),
                at(s3, 4, (8, 2, F))]

    kept, flipped = _core.CudaEngine.plan_by_steps(roles, step_us, 0.01)
    assert kept == [(2, 2, F), (1, 2, F), (2, 2, F), (4, 2, F), (8, 2, F)] and flipped == 3
    assert calls == expected_calls(True)
    calls.clear()
    # nothing flips; role 0's fastest is also the other kernel's fastest: timed once
    assert _core.CudaEngine.plan_by_steps(roles, step_us, 0.1) == (base, 0)
    assert calls == expected_calls(False)
    # on the tensor-core product (R = 16), the fastest alone: the fastest of rows per warp and of split-K are timed
    calls.clear()

    def step16(chosen):
        calls.append(chosen)
        return 1000.0 - (30.0 if chosen[0] == (8, 2, F) else 0.0)

    one = [(16, 0, F, [(16, 0, F, 1.0), (2, 2, F, 1.1), (4, 2, F, 1.3), (8, 2, F, 1.2)])]
    assert _core.CudaEngine.plan_by_steps(one, step16, 0.01) == ([(8, 2, F)], 1)
    assert calls == [[(16, 0, F)], [(2, 2, F)], [(8, 2, F)]]


def test_step_check_keeps_each_pick_to_the_rules_or_the_fastest():
    """CudaOptions.gemv_step_check (the default): every role ends on the rules' pick (recomputed from its own
    timings, as in the test below), on its fastest variant alone or on the fastest of the other kernel than the
    rules' pick (split-K / rows per warp), and the option is part of the saved plan's key."""
    from tinyinfer import _core
    from tinyinfer.bench import shape_config

    cfg = shape_config("smollm2-135m")
    o = _core.CudaOptions()
    o.gemv_resident_margin = 1.0  # the rules then often pick far from the fastest: flips to try
    off = _core.CudaOptions()
    off.gemv_step_check = False
    assert _core.CudaEngine.plan_key(cfg, 256, o) != _core.CudaEngine.plan_key(cfg, 256, off)
    eng = _core.CudaEngine.random(cfg, 256, 1, o)
    for g in eng.gemv_table():
        tried = list(zip(g["tried_R"], g["tried_blocks_per_sm"], g["us"]))
        fastest = min(tried, key=lambda t: t[2])[:2]
        cands = [(R, us) for R, b, us in tried if b == 2 and us <= 2.0 * min(t[2] for t in tried)]
        sign = -1 if g["name"] == "qkv" else 1
        rule = (min(cands, key=lambda c: (sign * (8 if c[0] == 8 else 8 * c[0]), c[1]))[0], 2)
        others = [t for t in tried if (t[0] == 8) != (rule[0] == 8)]
        other = min(others, key=lambda t: t[2])[:2] if others else None
        assert (g["R"], g["blocks_per_sm"]) in (fastest, rule, other), g
    assert eng.time_decode_step(16, 8) > 0


@pytest.mark.parametrize("roles", ["o_down", "all"])
@pytest.mark.parametrize("dtype", ["fp16", "int8", "int4"])
def test_tensor_core_product_matches_cpu(tmp_path, dtype, roles):
    """gemv_pins R = 16 (kGemvMmaOneRow: the one-row tensor-core product, cuda/mma_one_row.cu; the normed roles'
    RMSNorm in its prologue) for o and down, or for every role: greedy tokens within the tolerance
    of the CPU engine's argmax through 80 steps (past the attention's first chunk: the merge runs too), the last
    step's logits within 2e-2 of the CPU's on the same tokens and not bitwise an unpinned engine's (the product
    ran), the picks in the plan table; refused with trace (no stamps)."""
    from tinyinfer import InvalidRequestError, _core

    d = make_llama(tmp_path / "m", vocab=1000, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                   layers=2, tie=roles == "all")  # (all: a tied head, at fp16 the embedding itself)
    Role = _core.MatrixRole
    pinned = [Role.O, Role.Down] if roles == "o_down" else [Role.Qkv, Role.O, Role.GateUp, Role.Down, Role.LmHead]
    o = _core.CudaOptions()
    o.gemv_pins = [_core.GemvPin(r, 16, 0) for r in pinned]
    gpu = Engine(d, device="cuda", dtype=dtype, max_seq_len=300, cuda_options=o, plan_cache=False)
    table = {g["name"]: g["R"] for g in gpu._core.gemv_table()}
    names = {Role.Qkv: "qkv", Role.O: "o", Role.GateUp: "gate_up", Role.Down: "down", Role.LmHead: "lm_head"}
    assert {n: R == 16 for n, R in table.items()} == {n: r in pinned for r, n in names.items()}
    cpu = Engine(d, device="cpu", dtype={"fp16": "fp32"}.get(dtype, dtype), max_seq_len=300)
    prompt = [5, 17, 400, 23, 99, 7]
    out = gpu.generate(prompt, max_tokens=80, ignore_eos=True).token_ids
    ref = cpu.logits(prompt + out[:-1])[len(prompt) - 1:]
    scale = np.abs(ref).max()
    assert np.all(ref[np.arange(80), out] >= ref.max(-1) - 2e-2 * scale)
    core = gpu._core
    core.reset()
    core.forward(prompt, False)
    assert list(core.decode(80, _core.SamplingConfig(), [], 0)) == out
    last = np.array(core.last_logits())
    assert np.abs(last - ref[-1]).max() < 2e-2 * scale
    plain = Engine(d, device="cuda", dtype=dtype, max_seq_len=300, plan_cache=False)._core
    plain.reset()
    plain.forward(prompt, False)
    plain.decode(80, _core.SamplingConfig(), [], 0)
    assert not np.array_equal(last, np.array(plain.last_logits()))  # another kernel's sums: R = 16 ran
    traced = _core.CudaOptions()
    traced.trace, traced.gemv_pins = True, o.gemv_pins
    with pytest.raises(InvalidRequestError, match="no trace stamps"):
        Engine(d, device="cuda", dtype=dtype, max_seq_len=300, cuda_options=traced, plan_cache=False)


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_gemv_mma_makes_the_tensor_core_product_a_candidate(tmp_path, dtype):
    """CudaOptions.gemv_mma: the tuner also times R = 16 (its own grid, fp16 inputs) for every role; with the rules
    and the step check off the fastest trial is kept, R = 16 included; off (the default) it is never timed; a
    narrowed search (gemv_rows / gemv_grid) leaves it out; the plan's key tells the two apart."""
    from tinyinfer import _core

    d = make_llama(tmp_path / "m", vocab=1000, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                   layers=2)

    def engine(**kw):
        o = _core.CudaOptions()
        o.gemv_resident_margin, o.gemv_step_check = 0.0, False
        for k, v in kw.items():
            setattr(o, k, v)
        return Engine(d, device="cuda", dtype=dtype, max_seq_len=300, cuda_options=o, plan_cache=False)._core

    assert not _core.CudaOptions().gemv_mma
    for g in engine().gemv_table():
        assert 16 not in g["tried_R"], g
    on = engine(gemv_mma=True)
    for g in on.gemv_table():
        assert g["tried_R"].count(16) == 1, g
        i = g["tried_R"].index(16)
        assert (g["tried_blocks_per_sm"][i], bool(g["tried_act8"][i])) == (0, False)
        fastest = min(range(len(g["us"])), key=lambda j: g["us"][j])
        assert (g["R"], g["blocks_per_sm"]) == (g["tried_R"][fastest], g["tried_blocks_per_sm"][fastest]), g
    for g in engine(gemv_mma=True, gemv_grid=2).gemv_table():
        assert 16 not in g["tried_R"], g
    assert on.time_decode_step(16, 8) > 0
    key = _core.CudaEngine.plan_key
    cfg = on.config
    a, b = _core.CudaOptions(), _core.CudaOptions()
    b.gemv_mma = True
    assert key(cfg, 300, a) != key(cfg, 300, b)


def test_gemv_and_trace_options_are_checked():
    """The GEMV options (grid, resident margin, pins, decode_long_from) refused by name, pins and the resident rule
    honoured, trace_step refused on an engine built without CudaOptions.trace; any build."""
    from tinyinfer import InvalidRequestError, _core
    from tinyinfer.bench import shape_config

    cfg = shape_config("smollm2-135m")
    bad = _core.CudaOptions()
    bad.gemv_grid = 3
    with pytest.raises(InvalidRequestError, match="gemv_grid"):
        _core.CudaEngine.random(cfg, 256, 1, bad)
    bad.gemv_grid, bad.gemv_resident_margin = -1, 2.0
    with pytest.raises(InvalidRequestError, match="gemv_resident_margin"):
        _core.CudaEngine.random(cfg, 256, 1, bad)
    Role = _core.MatrixRole
    pin = _core.GemvPin(Role.Qkv, 2, 2)
    for field, value, what in [("rows_per_warp", 3, "rows_per_warp must be"), ("blocks_per_sm", 5, "blocks_per_sm must be")]:
        bad_pin = _core.GemvPin(Role.Qkv, 2, 2)
        setattr(bad_pin, field, value)  # past the constructor's check: the engine checks again
        bad = _core.CudaOptions()
        bad.gemv_pins = [pin, bad_pin]
        with pytest.raises(InvalidRequestError, match=what):
            _core.CudaEngine.random(cfg, 256, 1, bad)
    bad = _core.CudaOptions()
    bad.gemv_pins = [_core.GemvPin(Role.GateUp, 1, 2)]
    with pytest.raises(InvalidRequestError, match="no variant rows_per_warp=1 for gate_up"):
        _core.CudaEngine.random(cfg, 256, 1, bad)
    bad = _core.CudaOptions()
    bad.decode_long_from = -2
    with pytest.raises(InvalidRequestError, match="decode_long_from"):
        _core.CudaEngine.random(cfg, 256, 1, bad)
    bad = _core.CudaOptions()  # (checked before the build's own trace check: any build)
    bad.gemv_pins, bad.trace = [_core.GemvPin(Role.O, 16, 0)], True
    with pytest.raises(InvalidRequestError, match=r"tensor-core product \(16\) has no trace stamps"):
        _core.CudaEngine.random(cfg, 256, 1, bad)
    forced = _core.CudaOptions()
    forced.gemv_pins = [_core.GemvPin(Role.Qkv, 1, 0), _core.GemvPin(Role.Down, 8, 1)]
    table = {g["name"]: g for g in _core.CudaEngine.random(cfg, 256, 1, forced).gemv_table()}
    assert (table["qkv"]["R"], table["qkv"]["blocks_per_sm"], table["down"]["R"], table["down"]["blocks_per_sm"]) == (1, 0, 8, 1)
    resident = _core.CudaOptions()
    resident.gemv_resident_margin = 1.0  # any 2-per-SM variant within 2x of the fastest: all of them here
    resident.gemv_step_check = False  # the rules alone (the whole-step check may overrule them: tested below)
    for small in (True, False):
        resident.gemv_small_tiles = small
        for g in _core.CudaEngine.random(cfg, 256, 1, resident).gemv_table():
            assert g["blocks_per_sm"] == 2
            # the pick among the 2-per-SM variants within the margin: the smallest tiles first (8 rows: R = 1 or
            # the split-K R = 8; for qkv, before the attention, the largest), then the fastest
            cands = [(R, us) for R, b, us in zip(g["tried_R"], g["tried_blocks_per_sm"], g["us"])
                     if b == 2 and us <= 2.0 * min(g["us"])]
            sign = -1 if g["name"] == "qkv" else 1
            key = (lambda c: (sign * (8 if c[0] == 8 else 8 * c[0]), c[1])) if small else (lambda c: c[1])
            assert g["R"] == min(cands, key=key)[0], (small, g)
    plain = _core.CudaEngine.random(cfg, 256, 1)
    with pytest.raises(InvalidRequestError, match="CudaOptions.trace"):
        plain.trace_step(16)
    one = _core.CudaOptions()
    one.weights, one.gemv_grid = "int4", 1
    eng = _core.CudaEngine.random(cfg, 256, 1, one)
    assert all(g["blocks_per_sm"] == 1 for g in eng.gemv_table())  # gemv_grid = 1: one block per SM everywhere
    assert eng.time_decode_step(16, 4) > 0


def test_trace_step_stamps_every_kernel_in_order():
    """CudaEngine.trace_step in a -DTINYINFER_TRACE=ON build: every kernel of the step in order, each block's
    stamps in order, no block past its wait before the previous kernel ended. Skipped in other builds."""
    from tinyinfer import InvalidRequestError, _core
    from tinyinfer.bench import shape_config

    cfg = shape_config("smollm2-135m")
    o = _core.CudaOptions()
    o.trace, o.weights, o.gemv_grid = True, "int4", 1
    try:
        eng = _core.CudaEngine.random(cfg, 256, 1, o)
    except InvalidRequestError as e:  # a build without tracing says so (its options: the test above)
        assert "this build has no tracing (rebuild with CMAKE_ARGS=-DTINYINFER_TRACE=ON)" in str(e)
        pytest.skip("built without -DTINYINFER_TRACE=ON: the trace itself is not checked")
    with pytest.raises(InvalidRequestError, match="context"):
        eng.trace_step(10**6)
    tr = eng.trace_step(16)
    names = [n for n, _ in tr]
    assert names[:5] == ["qkv", "attention", "o", "gate_up", "down"] and names[-1] == "lm_head"
    assert len(names) == 5 * cfg.n_layers + 1
    assert all(g["blocks_per_sm"] == 1 for g in eng.gemv_table())
    prev_end = 0.0
    for name, flat in tr:
        a = np.array(flat, dtype=np.float64).reshape(-1, 6)  # 5 stamps, then the SM
        ran = a[a[:, 3] > 0]  # blocks that ran to the end (attention chunks past pos exit at once)
        assert len(ran) > 0, name
        assert (np.diff(ran[:, :4], axis=1) >= 0).all(), name  # start <= wait <= prologue <= end in every block
        if name == "attention":
            assert (ran[:, 4] == 0).all()
        else:  # a GEMV: its first dot products after the prologue, before the end
            assert ((ran[:, 2] <= ran[:, 4]) & (ran[:, 4] <= ran[:, 3])).all(), name
        assert len(ran) == 1 or len(np.unique(ran[:, 5])) > 1, name  # the SM column is written (ids need not be dense)
        assert ran[:, 1].min() >= prev_end, name  # no block passes its wait before the previous kernel ended
        prev_end = ran[:, 3].max()
    assert eng.time_decode_step(16, 4) > 0  # still usable
