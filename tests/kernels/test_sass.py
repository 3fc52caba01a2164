"""The compiled decode kernel's shape, from its sm_90 SASS (no GPU needed; see ``sass.py``).

The tile loop of ``paged_decode`` must read K and V with 128-bit loads only (no 16-bit or
32-bit loads of the cache; the 32-bit loads left are the block-table lookups of the K prefetch),
and a thread must have several of them in flight before the first instruction that uses one.
ptxas must report no spills and no stack, and the registers documented in docs/kernels.md.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sass import disassemble, loop_shape, parse_sass, skip_reason, tile_loop

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

# (dtype code, head_size) -> (registers, 128-bit loads per thread per tile, loads in flight
# before the first use). Registers as documented in docs/kernels.md (sm_90, nvcc 13.0); a
# change of more than 8 either way is a change of the kernel's occupancy and must be
# documented. Block size 16 (the table lookups are its only dependence on it).
EXPECTED = {
    (0, 64): (147, 16, 16), (0, 80): (150, 26, 18), (0, 96): (158, 28, 23),
    (0, 128): (179, 32, 30), (0, 256): (239, 48, 42),
    (1, 64): (140, 8, 8), (1, 80): (156, 12, 12), (1, 96): (159, 13, 13),
    (1, 128): (168, 16, 16), (1, 256): (214, 32, 32),
    (2, 64): (136, 8, 8), (2, 128): (168, 16, 16), (2, 256): (209, 32, 32),
}
REGISTER_SLACK = 8


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[int, int], tuple[str, dict[str, int]]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        out = list(pool.map(lambda v: disassemble(v[0], v[1], 16), EXPECTED))
    return dict(zip(EXPECTED, out))


@pytest.mark.parametrize("variant", list(EXPECTED), ids=[f"{('f32', 'f16', 'bf16')[d]}-h{h}"
                                                         for d, h in EXPECTED])
def test_decode_loop_issues_wide_loads_in_flight(compiled, variant) -> None:
    sass, ptxas = compiled[variant]
    regs, loads128, in_flight = EXPECTED[variant]
    assert ptxas["spill_stores"] == 0 and ptxas["spill_loads"] == 0 and ptxas["stack"] == 0, ptxas
    assert abs(ptxas["registers"] - regs) <= REGISTER_SLACK, (
        f"{ptxas['registers']} registers, documented {regs}: update docs/kernels.md")
    shape = loop_shape(sass)
    assert shape.barriers == 3, shape.summary()
    narrow = {w: n for w, n in shape.loads_by_width.items() if w not in ("128", "32")}
    assert not narrow, f"sub-32-bit global loads in the tile loop: {shape.summary()}"
    assert shape.loads_by_width.get("32", 0) <= 2, shape.summary()  # the two table lookups
    assert shape.loads_by_width.get("128", 0) >= loads128, shape.summary()
    # Several 16-byte loads in flight before the first use, and before the first dependent FMA.
    assert max(shape.in_flight_first_use) >= min(in_flight, 8), shape.summary()
    assert max(shape.in_flight_first_fma) >= min(in_flight, 8), shape.summary()


def test_the_sass_reader_finds_loads_and_their_first_use() -> None:
    # A hand-written loop: two 128-bit loads, the first used after the second is issued.
    text = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.128.CONSTANT R4, desc[UR6][R2.64] ;
        /*0020*/                   LDG.E.128.CONSTANT R8, desc[UR6][R2.64+0x10] ;
        /*0030*/                   LDG.E.U16.CONSTANT R12, desc[UR6][R2.64+0x20] ;
        /*0040*/                   HADD2.F32 R13, -RZ, R5.H0_H0 ;
        /*0050*/                   FFMA R14, R13, R13, R14 ;
        /*0060*/                   FFMA R14, R8, R9, R14 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/               @P0 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
    """
    instrs = parse_sass(text)
    assert tile_loop(instrs) == (1, 8)
    assert instrs[1].dests() == {4, 5, 6, 7} and instrs[4].sources() == {5}
    shape = loop_shape(text)
    assert shape.loads_by_width == {"128": 2, "16": 1}
    assert shape.in_flight_first_use == [2, 1]
    assert shape.in_flight_first_fma == [2, 1]
