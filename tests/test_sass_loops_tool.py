"""bench/tools/sass_loops.py: the loops of a kernel's SASS and their instruction mix (synthetic SASS here; in use
its input is cuobjdump's output for a compiled kernel)."""

from __future__ import annotations

from conftest import load_script

SASS = """
        code for sm_90
                Function : _Z6kernelv
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
                                                                               /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                          /* 0x0000000000007919 */
                                                                               /* 0x000e220000002100 */
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;            /* 0x0000000402047981 */
                                                                               /* 0x000ea2000c1e1d00 */
        /*0030*/                   HMMA.16816.F32 R8, R4, R6, R8 ;             /* 0x000000060408723c */
                                                                               /* 0x004fe20000001808 */
        /*0040*/               @P0 LDS.128 R12, [R3] ;                         /* 0x000000000300c984 */
                                                                               /* 0x000e240000000c00 */
        /*0050*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;         /* 0x000000100000780c */
                                                                               /* 0x000fda0003f06270 */
        /*0060*/              @!P0 BRA 0x20 ;                                  /* 0x000000ffffec8947 */
                                                                               /* 0x000fea000383ffff */
        /*0070*/                   BRA 0x80 ;                                  /* 0x0000000000007947 */
                                                                               /* 0x000fea0003800000 */
        /*0080*/                   EXIT ;                                      /* 0x000000000000794d */
                                                                               /* 0x000fea0003800000 */
                Function : _Z5otherv
        /*0000*/                   EXIT ;                                      /* 0x000000000000794d */
                                                                               /* 0x000fea0003800000 */
"""


def test_a_backward_branch_is_a_loop_and_its_mix_is_counted():
    mod = load_script("bench/tools/sass_loops.py")
    kernels = mod.parse(SASS)
    assert list(kernels) == ["_Z6kernelv", "_Z5otherv"]
    assert len(kernels["_Z6kernelv"]) == 9 and kernels["_Z5otherv"] == [(0, "EXIT")]
    (lp,) = mod.loops(kernels["_Z6kernelv"])  # the forward BRA 0x80 is no loop
    assert (lp["start"], lp["end"], lp["count"]) == (0x20, 0x60, 5)
    assert lp["mix"] == {"LDG": 1, "HMMA": 1, "LDS": 1, "ISETP": 1, "BRA": 1}
    assert lp["loads"] == {"LDG.E.128": 1, "LDS.128": 1}  # the predicate dropped
    assert mod.loops(kernels["_Z5otherv"]) == []


def test_an_opcode_keeps_its_modifiers_and_drops_its_predicate():
    mod = load_script("bench/tools/sass_loops.py")
    assert mod.opcode("@!P1 LDG.E.EF.128 R8, desc[UR8][R8.64+0x800]") == "LDG.E.EF.128"
    assert mod.opcode("@UP0 BRA 0x100") == "BRA"
    assert mod.opcode("HMMA.16816.F32 R44, R48, R8, R44") == "HMMA.16816.F32"
