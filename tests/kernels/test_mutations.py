"""Planted bugs in the real decode kernels must be caught by the CPU tests.

Each mutation edits one spot of a copy of ``paged_attention.cu`` (a missing barrier, a wrong
reduction, a missing mask, ...). The detection suite is a few decode cases run under the two
warp-by-warp schedules with NaN and huge-finite shared-memory poison, exactly as in
test_kernels.py. A mutation is caught when the harness raises or an output leaves the reference
tolerance; every mutation must be caught.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from kernel_runners import CPU_SCHEDULES
from kernel_cases import TOLERANCES, make_decode_case, plant_late_maximum, reference_decode

from cuda_harness import HarnessError
from cuda_harness.backend import HarnessBackend

from batchgen.kernels.cuda.cuda_attention import KERNEL_HEADER, KERNEL_SOURCE, PARTITION_SIZE, KernelOps

# float32 with head size 80: 20 vectors per row, so the P V phase reads 6 token slots side by side
# (8 threads idle) in two batches per tile (8 tokens, then 3), and 5 K vectors per lane.
DTYPE, HEAD, BLOCK = torch.float32, 80, 16

# name -> (exact text in paged_attention.cu, replacement)
MUTATIONS: dict[str, tuple[str, str]] = {
    "no barrier after loading q": (
        "  __syncthreads();\n\n  for (int tile = start", "\n  for (int tile = start"),
    "no barrier after the logits": (
        "    __syncthreads();\n\n    // The first batch", "\n    // The first batch"),
    "no barrier after the softmax": (
        "    __syncthreads();\n\n    // Phase 3", "\n    // Phase 3"),
    "no barrier at the end of a tile": (
        "    __syncthreads();  // p_s, alpha_s", "    // p_s, alpha_s"),
    "half the lanes in the q.k reduction": (
        "m < BG_LANES_PER_TOKEN; m <<= 1", "m < BG_LANES_PER_TOKEN / 2; m <<= 1"),
    "no rescale of the accumulator": ("acc[g][e] *= alpha;", "acc[g][e] += 0.0f * alpha;"),
    "K prefetch reloads the current tile": (
        "BG_LOAD_K_TILE(tile + BG_TILE)", "BG_LOAD_K_TILE(tile)"),
    "V batches after the first not loaded": (
        "      if (b0 > 0) {\n        BG_LOAD_V_BATCH(b0)\n      }\n", ""),
    "no barrier before the epilogue sum": ("  __syncthreads();\n  // l_s > 0", "  // l_s > 0"),
    "epilogue sums the first token slot only": (
        "for (int s = 0; s < BG_V_SLOTS; ++s) o +=", "for (int s = 0; s < 1; ++s) o +="),
    "tokens past the context not masked": (
        "valid ? dot : BG_NEG_INF", "(valid || true) ? dot : BG_NEG_INF"),
    "running max not initialised": ("    m_s[tid] = BG_NEG_INF;\n", ""),
    "tile max over half the logits": ("bg_warp_max(fmaxf(x0, x1))", "bg_warp_max(x0)"),
    "reduce ignores the denominators": (
        "__expf(ml[2 * p] - mx) * ml[2 * p + 1]", "__expf(ml[2 * p] - mx)"),
    "reduce sums the first warp's partitions only": (
        "for (int w = 0; w < BG_NUM_WARPS; ++w) sum +=", "for (int w = 0; w < 1; ++w) sum +="),
    "reduce takes the first warp's maximum only": (
        "for (int w = 1; w < BG_NUM_WARPS; ++w) mx =", "for (int w = 1; w < 1; ++w) mx ="),
    "off-by-one block lookup": ("table[pos / BG_BLOCK_SIZE]", "table[(pos + 1) / BG_BLOCK_SIZE]"),
    "window starts a key late": (
        "ctx > window ? ctx - window : 0;  // the first key", "ctx > window ? ctx - window + 1 : 0;  // the first key"),
    "window ignored by the reduce": (
        "ctx > window ? ctx - window : 0;  // as paged_decode", "ctx > window ? 0 : 0;  // as paged_decode"),
    "soft cap not applied": ("if (softcap > 0.0f) dot = ", "if (softcap < 0.0f) dot = "),
    "idle threads leave before the barriers": (
        "  __syncthreads();\n\n  for (int tile = start",
        "  if (tid >= BG_HEAD_SIZE) return;\n  __syncthreads();\n\n  for (int tile = start"),
}


def detection_cases():
    peaked = make_decode_case(dtype=DTYPE, head_size=HEAD, block_size=BLOCK, context_lens=[90, 33],
                              group=2, seed=23)
    peaked.query *= 200  # logits of order 1000: exp overflows unless the true max is subtracted
    # 36 partitions, the largest logits in the last four (handled by the reduce's second warp).
    late = make_decode_case(dtype=DTYPE, head_size=HEAD, block_size=BLOCK, context_lens=[9001],
                            num_kv_heads=1, group=1, seed=24)
    late.query *= 50
    plant_late_maximum(late, 0, 32 * PARTITION_SIZE)
    # a window ending inside a block, across split-K partitions, soft-capped
    windowed = make_decode_case(dtype=DTYPE, head_size=HEAD, block_size=BLOCK, context_lens=[20, 700, 5],
                                num_kv_heads=1, group=2, seed=25)
    windowed.query *= 4
    windowed.sliding_window, windowed.logits_soft_cap = 2 * PARTITION_SIZE - 7, 1.5
    # a window of fewer keys than a partition over a context of several: one partition
    short_window = make_decode_case(dtype=DTYPE, head_size=HEAD, block_size=BLOCK, context_lens=[300, 700],
                                    num_kv_heads=1, group=1, seed=26)
    short_window.sliding_window = PARTITION_SIZE - 56
    return [
        peaked,
        make_decode_case(dtype=DTYPE, head_size=HEAD, block_size=BLOCK,
                         context_lens=[1, 15, 16, 17, 65, 130], group=3, seed=21),
        make_decode_case(dtype=DTYPE, head_size=HEAD, block_size=BLOCK, context_lens=[300, 600],
                         num_kv_heads=1, group=2, seed=22),
        late,
        windowed,
        short_window,
    ]


def caught(source: Path) -> str | None:
    """How the detection suite notices the kernel in ``source`` is wrong, or None if it passes."""
    atol, rtol = TOLERANCES[DTYPE]
    for schedule, poison in CPU_SCHEDULES:
        ops = KernelOps(HarnessBackend(source, schedule=schedule, poison=poison))
        for i, case in enumerate(detection_cases()):
            try:
                out = ops.paged_decode_attention(*case.args(), **case.options()).float()
            except HarnessError as exc:
                return f"{schedule}/{poison} case {i}: harness error: {str(exc)[:120]}"
            ref = reference_decode(case)
            if not torch.allclose(out, ref, atol=atol, rtol=rtol):
                return f"{schedule}/{poison} case {i}: max error {(out - ref).abs().nan_to_num(1e9).max():.3g}"
    return None


def mutated_copy(root: Path, name: str, old: str, new: str) -> Path:
    text = KERNEL_SOURCE.read_text()
    assert text.count(old) == 1, f"mutation {name!r}: its target text must occur exactly once"
    folder = root / name.replace(" ", "_").replace(".", "")
    folder.mkdir()
    shutil.copy(KERNEL_HEADER, folder / KERNEL_HEADER.name)
    (folder / KERNEL_SOURCE.name).write_text(text.replace(old, new))
    return folder / KERNEL_SOURCE.name


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mutants")
    paths = {name: mutated_copy(root, name, *m) for name, m in MUTATIONS.items()}
    # Build all mutants two at a time before the (sequential) detection runs.
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda p: HarnessBackend(p).module(DTYPE, HEAD, BLOCK), paths.values()))
    return paths


def test_unmutated_kernel_passes_the_detection_suite() -> None:
    assert caught(KERNEL_SOURCE) is None


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(sources: dict[str, Path], name: str) -> None:
    how = caught(sources[name])
    assert how is not None, f"planted bug {name!r} went unnoticed"
    print(f"{name}: {how}")
