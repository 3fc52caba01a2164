"""The ``cpu`` backend: the C attention kernel (decode and prefill) against the torch reference,
its batch-, chunk- and thread-invariance, its checks, its build.

The kernel is built here by the system C compiler exactly as the engine builds it; a machine
without one skips these tests with that reason (the engine then falls back to ``torch``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import assert_close_to_reference, make_decode_case, reference_decode

from batchgen.kernels import cpu as kcpu
from batchgen.kernels import cpu_unsupported_reason, get_ops
from batchgen.kernels import torch_attention as reference
from batchgen.kernels.cpu import c_build, quant

pytestmark = pytest.mark.skipif(kcpu.compiler() is None, reason="no C compiler (cc/gcc) on this machine")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads(), c_build.num_threads()
    torch.set_num_threads(1)
    c_build.set_num_threads(1)
    yield
    torch.set_num_threads(before[0])
    c_build.set_num_threads(before[1])


def prefill_inputs(case, q_lens: list[int], seed: int = 0):
    """Prefill queries over ``case``'s cache: sequence s's last ``q_lens[s]`` tokens."""
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(starts[-1], *case.query.shape[1:], generator=gen).to(case.query.dtype)
    return query, torch.tensor(starts, dtype=torch.int32)


def prefill(ops, case, query, starts):
    return ops.paged_prefill_attention(query, case.k_cache, case.v_cache, case.block_tables,
                                       starts, case.context_lens, case.scale)


@pytest.mark.parametrize("head_size,group,block_size", [
    (64, 3, 16),    # SmolLM2
    (64, 1, 8),     # plain multi-head
    (128, 4, 16),
    (80, 8, 32),    # head size not a power of two, a wide group
    (32, 2, 1),     # one token per block
    (96, 16, 16),   # the largest group
    (256, 2, 16),   # a head too wide for one pass of accumulators
])
def test_decode_matches_the_reference(head_size: int, group: int, block_size: int) -> None:
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 137, 300]
    case = make_decode_case(dtype=torch.float32, head_size=head_size, block_size=block_size,
                            context_lens=lens, num_kv_heads=2, group=group, seed=head_size + group)
    out = get_ops("cpu").paged_decode_attention(*case.args())
    assert out.shape == case.query.shape and out.dtype == torch.float32
    assert_close_to_reference(out, reference_decode(case), torch.float32, f"h{head_size} g{group}")


def test_shared_prefix_blocks_and_strided_query() -> None:
    """Forked sequences read the same physical blocks; the query arrives as a transposed view."""
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=16,
                            context_lens=[40, 70, 33, 64], num_kv_heads=3, group=3,
                            shared_prefix_blocks=2, seed=7)
    strided = case.query.transpose(0, 1).contiguous().transpose(0, 1)  # [S, H, D], S-stride D
    assert not strided.is_contiguous()
    ops = get_ops("cpu")
    out = ops.paged_decode_attention(strided, *case.args()[1:])
    assert_close_to_reference(out, reference_decode(case), torch.float32, "strided")
    assert torch.equal(out, ops.paged_decode_attention(*case.args()))


def test_a_sequence_result_does_not_depend_on_the_batch() -> None:
    """Each sequence is computed on its own: alone or in a batch, bit for bit."""
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=16,
                            context_lens=[5, 200, 17, 64, 90], num_kv_heads=3, group=3, seed=3)
    ops = get_ops("cpu")
    together = ops.paged_decode_attention(*case.args())
    for row in range(5):
        alone = ops.paged_decode_attention(*case.select([row]).args())
        assert torch.equal(alone[0], together[row]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_and_prefill_in_half_precision_caches(dtype: torch.dtype) -> None:
    """bfloat16 and float16 caches are read into float32; the output is rounded once."""
    case = make_decode_case(dtype=dtype, head_size=64, block_size=16, context_lens=[1, 17, 130],
                            num_kv_heads=2, group=3, seed=5)
    ops = get_ops("cpu")
    out = ops.paged_decode_attention(*case.args())
    assert out.dtype == dtype
    assert_close_to_reference(out, reference_decode(case), dtype, f"decode {dtype}")
    query, starts = prefill_inputs(case, [1, 9, 130])
    out = prefill(ops, case, query, starts)
    ref = reference.paged_prefill_attention(query.float(), case.k_cache.float(), case.v_cache.float(),
                                            case.block_tables, starts, case.context_lens, case.scale)
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, dtype, f"prefill {dtype}")


@pytest.mark.parametrize("head_size,group,block_size", [(64, 3, 16), (80, 8, 32), (32, 2, 1), (96, 16, 16),
                                                       (256, 2, 8)])
def test_prefill_matches_the_reference(head_size: int, group: int, block_size: int) -> None:
    """Whole prompts, chunks over a cached prefix, one-token chunks, and an empty query."""
    lens = [1, block_size + 1, 37, 137, 300, 64]
    case = make_decode_case(dtype=torch.float32, head_size=head_size, block_size=block_size,
                            context_lens=lens, num_kv_heads=2, group=group, seed=head_size)
    query, starts = prefill_inputs(case, [1, block_size + 1, 5, 1, 300, 0], seed=group)
    out = prefill(get_ops("cpu"), case, query, starts)
    ref = reference.paged_prefill_attention(query, case.k_cache, case.v_cache, case.block_tables,
                                            starts, case.context_lens, case.scale)
    assert_close_to_reference(out, ref, torch.float32, f"prefill h{head_size} g{group}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_is_computed_the_same_by_decode_by_any_prefill_chunk_and_in_any_batch(dtype) -> None:
    """The kernel's contract for reproducibility: one query row's result is a function of its
    query and its context alone. Compute every token of a 150-token sequence (and of two
    neighbours) as whole-prompt prefill, as prefill chunks of several sizes after a cached
    prefix, as single decodes, alone and batched: every route gives the same bits."""
    lens = [150, 90, 33]
    case = make_decode_case(dtype=dtype, head_size=64, block_size=16, context_lens=lens,
                            num_kv_heads=3, group=3, seed=21)
    ops = get_ops("cpu")
    gen = torch.Generator().manual_seed(4)
    # one query vector per token of each sequence
    queries = [torch.randn(n, 9, 64, generator=gen).to(dtype) for n in lens]

    def chunk(s: int, begin: int, end: int) -> torch.Tensor:
        """Tokens begin..end-1 of sequence s as one prefill chunk, alone."""
        one = case.select([s])
        one.context_lens = torch.tensor([end], dtype=torch.int32)
        return prefill(ops, one, queries[s][begin:end], torch.tensor([0, end - begin], dtype=torch.int32))

    whole = [chunk(s, 0, n) for s, n in enumerate(lens)]
    for s, n in enumerate(lens):
        for size in (1, 7, 16, 61):
            parts = torch.cat([chunk(s, b, min(b + size, n)) for b in range(0, n, size)])
            assert torch.equal(parts, whole[s]), (s, size)
    # decode of each token (the batch holds the three sequences at different positions)
    for p in (0, 15, 16, 32, 89):
        pos = [min(p, n - 1) for n in lens]
        dec = ops.paged_decode_attention(torch.stack([queries[s][q] for s, q in enumerate(pos)]),
                                         case.k_cache, case.v_cache, case.block_tables,
                                         torch.tensor([q + 1 for q in pos], dtype=torch.int32), case.scale)
        for s, q in enumerate(pos):
            assert torch.equal(dec[s], whole[s][q]), (s, q)
    # all three sequences in one prefill call, with mid-sequence chunks
    begins = [100, 0, 30]
    starts = torch.tensor([0, 50, 140, 143], dtype=torch.int32)
    batched = prefill(ops, case, torch.cat([queries[s][b:] for s, b in enumerate(begins)]), starts)
    for s, b in enumerate(begins):
        assert torch.equal(batched[starts[s]:starts[s + 1]], whole[s][b:]), s


def test_a_long_context_s_larger_tiles_give_the_same_bits_as_short_chunks_and_decode() -> None:
    """A context of 1024 tokens or more is prefilled 16 tokens a tile instead of 4 (fewer reads
    of its K/V rows); each row's result must not tell: a 1100-token prompt in one call (large
    tiles), in chunks of 61 and 300 (small tiles until the context reaches 1024), and as
    decodes give the same bits, close to the reference."""
    n = 1100
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=16, context_lens=[n],
                            num_kv_heads=3, group=3, seed=8)
    ops = get_ops("cpu")
    q = torch.randn(n, 9, 64, generator=torch.Generator().manual_seed(9))

    def chunk(begin: int, end: int) -> torch.Tensor:
        one = case.select([0])
        one.context_lens = torch.tensor([end], dtype=torch.int32)
        return prefill(ops, one, q[begin:end], torch.tensor([0, end - begin], dtype=torch.int32))

    whole = chunk(0, n)
    ref = reference.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                            torch.tensor([0, n], dtype=torch.int32), case.context_lens, case.scale)
    assert_close_to_reference(whole, ref, torch.float32, "prefill of 1100 tokens")
    for size in (61, 300):
        assert torch.equal(torch.cat([chunk(b, min(b + size, n)) for b in range(0, n, size)]), whole), size
    for p in (0, 1023, 1024, 1099):
        dec = ops.paged_decode_attention(q[p:p + 1], case.k_cache, case.v_cache, case.block_tables,
                                         torch.tensor([p + 1], dtype=torch.int32), case.scale)
        assert torch.equal(dec[0], whole[p]), p


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_the_thread_count_does_not_change_the_result(threads: int) -> None:
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=16,
                            context_lens=[3, 250, 40, 41, 120, 7, 64, 65, 199] * 3, num_kv_heads=3,
                            group=3, seed=11)
    ops = get_ops("cpu")
    query, starts = prefill_inputs(case, [3, 250, 1, 41, 2, 7, 0, 65, 100] * 3)
    one = ops.paged_decode_attention(*case.args()), prefill(ops, case, query, starts)
    c_build.set_num_threads(threads)
    torch.set_num_threads(threads)
    many = ops.paged_decode_attention(*case.args()), prefill(ops, case, query, starts)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_prefill_inputs_outside_the_contract_are_refused() -> None:
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=16, context_lens=[20, 30],
                            num_kv_heads=2, group=2, seed=1)
    ops = get_ops("cpu")
    query, starts = prefill_inputs(case, [20, 30])
    for bad in ([0, 21, 50], [0, 30, 20], [1, 20, 50], [0, 20, 49]):
        with pytest.raises(ValueError, match="query_start_loc must rise from 0"):
            prefill(ops, case, query, torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit context_lens"):
        prefill(ops, case, query, starts[:2])
    with pytest.raises(ValueError, match="k_cache and v_cache must have one dtype"):
        ops.paged_prefill_attention(query, case.k_cache, case.v_cache.bfloat16(), case.block_tables,
                                    starts, case.context_lens, case.scale)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_cache_under_a_float32_query(kv_dtype: torch.dtype) -> None:
    """``kv_cache_dtype``: the kernel reads a 16-bit cache under a float32 query and returns
    float32 rows, the bits of a float32 cache holding the same values; the torch backend (the
    spec) takes the same cache and agrees within float32 rounding."""
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=16, context_lens=[1, 17, 130],
                            num_kv_heads=2, group=3, seed=8)
    k16, v16 = case.k_cache.to(kv_dtype), case.v_cache.to(kv_dtype)
    query, starts = prefill_inputs(case, [1, 9, 130])
    cpu, spec = get_ops("cpu"), get_ops("torch")
    for name, call in (("decode", lambda ops, k, v: ops.paged_decode_attention(
            case.query, k, v, case.block_tables, case.context_lens, case.scale)),
                       ("prefill", lambda ops, k, v: ops.paged_prefill_attention(
            query, k, v, case.block_tables, starts, case.context_lens, case.scale))):
        out = call(cpu, k16, v16)
        assert out.dtype == torch.float32, name
        assert torch.equal(out, call(cpu, k16.float(), v16.float())), name
        assert_close_to_reference(out, call(spec, k16, v16), torch.float32, f"{name}, {kv_dtype} cache")


@pytest.mark.parametrize("change,message", [
    (lambda c: c.__setattr__("context_lens", torch.tensor([0, 5], dtype=torch.int32)), "context_lens must be in"),
    (lambda c: c.__setattr__("context_lens", torch.tensor([5, 999], dtype=torch.int32)), "context_lens must be in"),
    (lambda c: c.block_tables.__setitem__((0, 0), 10_000), "block table entries must be in"),
    (lambda c: c.block_tables.__setitem__((1, 0), -1), "block table entries must be in"),
    (lambda c: c.__setattr__("query", c.query.double()), "query must be a float32, bfloat16 or float16 CPU"),
    (lambda c: c.__setattr__("query", c.query[:, :, :32]), "does not fit the cache"),
    (lambda c: c.__setattr__("context_lens", c.context_lens[:1]), "2 queries but"),
])
def test_inputs_outside_the_contract_are_refused(change, message: str) -> None:
    """The kernel follows raw indices, so every one it would follow is checked first."""
    case = make_decode_case(dtype=torch.float32, head_size=64, block_size=16, context_lens=[20, 30],
                            num_kv_heads=2, group=2, seed=1)
    change(case)
    with pytest.raises(ValueError, match=message):
        get_ops("cpu").paged_decode_attention(*case.args())


def test_unsupported_reason_names_what_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_unsupported_reason(torch.float32, 64, 9, 3) is None
    assert cpu_unsupported_reason(torch.bfloat16, 64, 9, 3) is None
    assert cpu_unsupported_reason(torch.float16, 64, 9, 3) is None
    assert "dtype torch.float64 unsupported" in cpu_unsupported_reason(torch.float64, 64, 9, 3)
    assert "at most 16" in cpu_unsupported_reason(torch.float32, 64, 34, 2)
    assert "not a multiple" in cpu_unsupported_reason(torch.float32, 64, 9, 2)
    assert "head_size 1024 unsupported" in cpu_unsupported_reason(torch.float32, 1024, 8, 8)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert "no C compiler" in cpu_unsupported_reason(torch.float32, 64, 9, 3)


def test_a_failed_build_says_why(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(kcpu.cpu_attention, "KERNEL_SOURCE", broken)
    monkeypatch.setattr(kcpu.c_build, "_loaded", {})
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(kcpu.CpuKernelError, match="could not build the CPU attention kernel"):
        kcpu.load(64, 3)
    assert not list((tmp_path / "cache" / "cpu_kernels").glob("*.so"))  # nothing half-written


def test_builds_are_cached_on_disk(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kcpu.c_build, "_loaded", {})
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    kcpu.load(48, 2)
    built = list((tmp_path / "cpu_kernels").glob("paged_attention-h48-g2-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(kcpu.c_build, "_loaded", {})
    kcpu.load(48, 2)  # a new process would find the file and not compile again
    assert built[0].stat().st_mtime_ns == stamp


def test_editing_a_header_included_from_a_header_rebuilds(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "outer.c"
    source.write_text('#include "middle.h"\nint outer_value(void) { return VALUE; }\n')
    (tmp_path / "middle.h").write_text('#include "inner.h"\n#include "inner.h"\n')
    (tmp_path / "inner.h").write_text("#define VALUE 1\n")
    assert c_build.local_headers(source) == [tmp_path / "middle.h", tmp_path / "inner.h"]
    values = []
    for value in (1, 2):
        (tmp_path / "inner.h").write_text(f"#define VALUE {value}\n")
        with c_build._build_lock:
            lib, _ = c_build.build("a header test", source, [])
        values.append(lib.outer_value())
    assert values == [1, 2]
    assert len(list((tmp_path / "cache" / "cpu_kernels").glob("outer-*.so"))) == 2


def test_the_quantized_kernel_hashes_all_its_headers() -> None:
    names = [header.name for header in c_build.local_headers(quant.QUANT_SOURCE)]
    assert set(names) >= {"pool.h", "quant_vec.h", "quant_rows.h", "quant_blocks.h", "quant_dots.h",
                          "quant_steps.h"}


def test_engine_falls_back_to_torch_when_the_kernel_cannot_serve(tiny_model, monkeypatch, caplog) -> None:
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.llm import load_runner

    path = tiny_model("llama")
    runner = load_runner(EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory=2**20))
    assert runner.attention_backend == "cpu"
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.model_runner"):
        runner = load_runner(EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory=2**20))
    assert runner.attention_backend == "torch"
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot serve this model: no C compiler"):
        load_runner(EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory=2**20, attention_backend="cpu"))
    monkeypatch.delenv("CC")
    bf16 = load_runner(EngineConfig(model=path, dtype="bfloat16", device="cpu", kv_cache_memory=2**20))
    assert bf16.attention_backend == "cpu"


def test_loading_the_kernel_keeps_subnormal_floats() -> None:
    """A library built with -ffast-math would switch the process to flush-to-zero on load."""
    kcpu.load(64, 3)
    kcpu.load(32, 1)
    assert 2.2250738585072014e-308 / 4.0 != 0.0
    assert (torch.tensor([1.0e-38]) / 100.0).item() != 0.0
    assert kcpu.c_build._subnormals_work()


def test_the_avx512_avx2_and_plain_c_builds_give_the_same_bits(tmp_path) -> None:
    """Every step is written for AVX-512 (16 keys' dot products and their reduction trees side
    by side, a vector exp, accumulators in registers), and again for AVX2 and plain C, with one
    order of operations, so a machine without AVX-512 reproduces an AVX-512 machine's results.
    Decode and prefill (rows that stop at different keys), in every dtype; head size 40 covers
    the partial last group of 16 lanes, context lengths the partial key blocks."""
    import ctypes

    case = make_decode_case(dtype=torch.float32, head_size=40, block_size=16,
                            context_lens=[1, 17, 130, 300], num_kv_heads=2, group=3, seed=5)
    query, starts = prefill_inputs(case, [1, 9, 30, 50], seed=6)
    results = []
    for extra in ((), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")):
        path = tmp_path / f"attention{len(extra)}.so"
        error = c_build._compile(kcpu.compiler(), kcpu.cpu_attention.KERNEL_SOURCE, ("-O3", "-march=native", *extra),
                                ["-DHEAD_SIZE=40", "-DGROUP=3"], path)
        if error is not None and not extra:
            pytest.skip(f"no -march=native build here: {error.splitlines()[-1]}")
        assert error is None, error
        lib = ctypes.CDLL(str(path))
        kcpu.cpu_attention._declare_attention(lib)
        # the variant each build runs: AVX-512 (AVX2 on a CPU without it), AVX2, plain C
        want = {0: 2 if c_build.missing_cpu_features("avx512f") is None else 1, 1: 1, 2: 0}[len(extra)]
        if c_build.missing_cpu_features("avx2", "fma", "f16c") is None:
            assert lib.batchgen_attention_isa() == want, extra
        outs = []
        for dtype, code in kcpu.cpu_attention.DTYPES.items():
            k, v = case.k_cache.to(dtype), case.v_cache.to(dtype)
            for q, loc in ((case.query.to(dtype), None), (query.to(dtype), starts)):
                out = torch.empty_like(q)
                assert lib.batchgen_paged_attention(
                    out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                    case.block_tables.data_ptr(), None if loc is None else loc.data_ptr(),
                    case.context_lens.data_ptr(), 4, q.shape[0], 2, 16, case.block_tables.shape[1],
                    q.stride(0), q.stride(1), case.scale, k.shape[0], code, code, 0, 0.0) == 0
                outs.append(out)
        results.append(outs)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
