"""flamia_verify.sass: the reading of a SASS listing that benchmarks/offline_resources.py prints (its
compile step needs Triton 3.6's sm_90a toolchain and is run by hand; the parsing is plain text)."""

from __future__ import annotations

import pytest

from flamia_verify.sass import parse_loops, sass_classes

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ; /* 0x01e0 */
        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR8], R88 ; /* 0x01e0 */
        /*0030*/                   MUFU.EX2 R2, R3 ;                       /* 0x0000000300027308 */
        /*0040*/               @P0 BRA 0x10 ;                              /* 0x000000dc00a03947 */
        /*0050*/                   BRA 0x60 ;                              /* 0x000000dc00a03947 */
        /*0060*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_a_backward_branch_is_a_loop_with_its_mma_cycles():
    (loop,) = parse_loops(LISTING, min_len=1)  # the forward BRA 0x60 is no loop
    assert loop["length"] == 4 and loop["mma"] == 2 and loop["mufu"] == 1
    cycles = 64 * 128 * 16 / 2048 + 64 * 128 * 32 / 4096  # BF16 and E4M3 dense rates: 64 + 64
    assert loop["issue_per_tensor"] == pytest.approx(4 / cycles)


def test_short_loops_are_left_out_and_a_loop_without_mma_has_no_ratio():
    assert parse_loops(LISTING, min_len=5) == []
    plain = "\n".join(line for line in LISTING.splitlines() if "GMMA" not in line)
    (loop,) = parse_loops(plain, min_len=1)
    assert loop["mma"] == 0 and loop["issue_per_tensor"] == float("inf")


def test_instructions_are_counted_by_class():
    ops = ["HGMMA", "FFMA", "MUFU", "LDL", "BRA", "EXIT"]
    assert sass_classes(ops) == {"mma": 1, "fp32": 1, "mufu": 1, "spill": 1, "other": 2, "total": 6}
