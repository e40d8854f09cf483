#!/usr/bin/env python3
"""A CPU check of twin.cu's addressing and fragment layouts, without a GPU.

Runs the twin's algorithm on small shapes with NumPy, statement by statement
as twin.cu writes it (the staged words' global and shared indices, every
lane's ldmatrix row address, the mma operands and the epilogue's stores),
with the PTX ISA's documented semantics of the three warp-wide instructions
modelled per lane:
  ldmatrix .m8n8 .x4 .b16: lane l gives the row address of matrix l / 8, row
    l % 8 (16 bytes); register j of lane t receives matrix j's row t / 4,
    elements 2 (t % 4) and + 1 (with .trans: elements [2 (t % 4)][t / 4] and
    [2 (t % 4) + 1][t / 4] of the stored matrix);
  mma .m16n8k16 .row.col f16 -> f32, g = lane / 4, t = lane % 4:
    a0 (g, 2t..2t+1), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..);
    b0 (k 2t..2t+1, n g), b1 (k 2t + 8.., n g);
    c0, c1 (g, 2t..2t+1), c2, c3 (g + 8, 2t..2t+1).
and compares the result with a float64 matmul, for both layouts and for the
one-stage twin and the cp.async rings' stage offsets. It checks the index
arithmetic (what a GPU run would otherwise be the first to test), not the
hardware. Needs only NumPy: python3 scripts/cuda_twin/emulate.py
"""
import sys

import numpy as np

BM, BN, BK = 128, 128, 64
KW = BK // 8
A_STRIDE = KW + 1
A_STAGE = BM * A_STRIDE


def layout(nn, threads):
    b_stride = BN // 8 + 1 if nn else KW + 1
    b_stage = BK * b_stride if nn else BN * b_stride
    b_row_words = BN // 8 if nn else KW
    return b_stride, b_stage, threads // b_row_words, b_row_words


def ldmatrix_x4(smem_words, addrs, trans):
    """addrs[l]: lane l's word address; returns regs[lane][j] as 2 halves."""
    mats = np.zeros((4, 8, 8), dtype=np.float64)
    for l in range(32):
        mats[l // 8, l % 8, :] = smem_words[addrs[l]]
    regs = np.zeros((32, 4, 2))
    for t in range(32):
        for j in range(4):
            if trans:
                regs[t, j] = [mats[j, 2 * (t % 4), t // 4], mats[j, 2 * (t % 4) + 1, t // 4]]
            else:
                regs[t, j] = mats[j, t // 4, 2 * (t % 4) : 2 * (t % 4) + 2]
    return regs


def mma_16816(acc, a, b0, b1):
    """acc[lane][4] += A (from a[lane][4][2]) * B (from b0, b1[lane][2])."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2 * t : 2 * t + 2] = a[lane, 0]
        A[g + 8, 2 * t : 2 * t + 2] = a[lane, 1]
        A[g, 2 * t + 8 : 2 * t + 10] = a[lane, 2]
        A[g + 8, 2 * t + 8 : 2 * t + 10] = a[lane, 3]
        B[2 * t : 2 * t + 2, g] = b0[lane]
        B[2 * t + 8 : 2 * t + 10, g] = b1[lane]
    D = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane, 0:2] += D[g, 2 * t : 2 * t + 2]
        acc[lane, 2:4] += D[g + 8, 2 * t : 2 * t + 2]


def run(nn, wn, m, n, k, stages, rng):
    """twin.cu's Cfg<nn, wn> with `stages` stages (1: twin_s1, else async_ring)."""
    threads = 64 * wn
    warp_n = BN // wn
    nt = warp_n // 8
    a_words = b_words = BM * KW // threads
    a_rows_per_i = threads // KW
    a = rng.integers(-8, 8, size=(m, k)).astype(np.float64)
    b = rng.integers(-8, 8, size=(k, n) if nn else (n, k)).astype(np.float64)
    lda, ldb = k, (n if nn else k)
    # Global memory in 16-byte words of 8 halves.
    gw_a = a.reshape(-1, 8)
    gw_b = b.reshape(-1, 8)
    c = np.full((m, n), np.nan)
    b_stride, b_stage, b_rows_per_i, b_row_words = layout(nn, threads)
    stage_words = A_STAGE + b_stage
    tiles_m = m // BM
    steps = k // BK
    for tile in range((m // BM) * (n // BN)):
        row0 = (tile % tiles_m) * BM
        col0 = (tile // tiles_m) * BN
        ldaw, ldbw = lda // 8, ldb // 8
        smem = np.zeros((stages * stage_words, 8))
        acc = np.zeros((2 * wn, 4, nt, 32, 4))  # warp, i, j, lane, 4
        for s in range(steps):
            st = s % stages
            sa, sb = st * stage_words, st * stage_words + A_STAGE
            for tid in range(threads):
                a_first = (row0 + tid // KW) * ldaw + tid % KW
                if nn:
                    b_first = (tid // (BN // 8)) * ldbw + col0 // 8 + tid % (BN // 8)
                else:
                    b_first = (col0 + tid // KW) * ldbw + tid % KW
                for i in range(a_words):
                    e = tid + i * threads
                    smem[sa + (e // KW) * A_STRIDE + e % KW] = gw_a[a_first + s * KW + i * a_rows_per_i * ldaw]
                for i in range(b_words):
                    e = tid + i * threads
                    if nn:
                        g = b_first + (s * BK + i * b_rows_per_i) * ldbw
                    else:
                        g = b_first + s * KW + i * b_rows_per_i * ldbw
                    smem[sb + (e // b_row_words) * b_stride + e % b_row_words] = gw_b[g]
            for warp in range(2 * wn):
                wr, wc = (warp // wn) * 64, (warp % wn) * warp_n
                for kk in range(BK // 16):
                    fa = []
                    for i in range(4):
                        addrs = [sa + (wr + i * 16 + (l % 16)) * A_STRIDE + kk * 2 + l // 16 for l in range(32)]
                        fa.append(ldmatrix_x4(smem, addrs, False))
                    fb = []
                    for jj in range(nt // 2):
                        addrs = []
                        for l in range(32):
                            q = l // 8
                            if nn:
                                krow = kk * 16 + (q % 2) * 8 + l % 8
                                word = (wc + jj * 16) // 8 + q // 2
                            else:
                                krow = wc + jj * 16 + (q // 2) * 8 + l % 8
                                word = kk * 2 + q % 2
                            addrs.append(sb + krow * b_stride + word)
                        fb.append(ldmatrix_x4(smem, addrs, nn))
                    for i in range(4):
                        for j in range(nt):
                            r = fb[j // 2]
                            mma_16816(acc[warp, i, j], fa[i], r[:, (j % 2) * 2], r[:, (j % 2) * 2 + 1])
        for warp in range(2 * wn):
            wr, wc = (warp // wn) * 64, (warp % wn) * warp_n
            for i in range(4):
                for j in range(nt):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        row = row0 + wr + i * 16 + g
                        col = col0 + wc + j * 8 + t * 2
                        c[row, col : col + 2] = acc[warp, i, j, lane, 0:2]
                        c[row + 8, col : col + 2] = acc[warp, i, j, lane, 2:4]
    want = a @ (b if nn else b.T)
    return np.array_equal(c, want), np.nanmax(np.abs(c - want)) if not np.isnan(c).all() else np.nan, int(np.isnan(c).sum())


def main():
    rng = np.random.default_rng(5)
    ok_all = True
    # m, n, k: 2 x 2 tiles (column-major tile order matters), 2 K steps.
    for nn in (False, True):
        for wn, stages in ((2, 1), (2, 2), (2, 3), (4, 1)):
            ok, err, nans = run(nn, wn, 256, 256, 128, stages, rng)
            name = f"{'nn (dx)' if nn else 'nt (logits)'} {2 * wn} warps, stages {stages}"
            print(f"emulate {name}: {'ok' if ok else 'WRONG'} (max err {err}, {nans} unwritten)")
            ok_all &= ok
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
