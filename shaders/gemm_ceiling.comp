// The ceiling report's diagnostic parts of the GEMM (MODE 1-4; headkl
// never runs them): compiled after gemm_khr_body.glsl (crates/glsl/build.rs
// joins them), so each times exactly the GEMM's own loads, staging and
// fragments. Only built with headkl-glsl's `ceiling` feature.
//   MODE 1 multiply-adds from registers (fragments loaded once); 2
//   fragments + multiply-adds from workgroup memory staged once; 3 the
//   global loads only; 4 the staging only (loads a step ahead, workgroup
//   stores, barriers), no math
#if MODE < 1 || MODE > 4
#error "gemm_ceiling.comp holds MODE 1-4"
#endif

// Keeps a diagnostic kernel's loads alive: one write, practically never
// taken, that depends on every word.
void sink(uvec4 x) {
    if (all(equal(x, uvec4(0x9e3779b9u)))) {
        c[p.c_offset] = 1.0;
    }
}

void main() {
    ENTER_TILE(1, p.k);

#if MODE == 1
    // The fragments of the subgroup's first K slice, straight from memory,
    // then steps x BK / 16 slices of multiply-adds on them.
    FRAG_A fa[4];
    FRAG_B fb[TN];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint row = min(row0 + wr + i * 16, p.m - 16);
        coopMatLoad(fa[i], a, (p.a_offset + row * p.lda) / 8, p.lda / 8, gl_CooperativeMatrixLayoutRowMajor);
    }
    [[unroll]] for (uint j = 0; j < TN; j++) {
        uint col = min(col0 + wc + j * FN, p.n - FN);
#if NN
        coopMatLoad(fb[j], b, col / 8, p.ldb / 8, gl_CooperativeMatrixLayoutRowMajor);
#else
        coopMatLoad(fb[j], b, (col * p.ldb) / 8, p.ldb / 8, gl_CooperativeMatrixLayoutColumnMajor);
#endif
    }
    for (uint s = 0; s < steps * (BK / 16); s++) {
        [[unroll]] for (uint i = 0; i < 4; i++) {
            [[unroll]] for (uint j = 0; j < TN; j++) {
                acc[i * TN + j] = coopMatMulAdd(fa[i], fb[j], acc[i * TN + j]);
            }
        }
    }
    epilogue();

#elif MODE == 2
    // Stage step 0 once, then multiply from it every step. `mask_rows` is 0 (no filter): the
    // shift only stops the compiler from hoisting the fragment loads.
    load_step(0);
    store_step(0);
    barrier();
    for (uint s = 0; s < steps; s++) {
        uint shift = s & p.mask_rows;
        [[unroll]] for (uint kk = 0; kk < BK; kk += 16) {
            math_slice(0, kk + shift * 16);
        }
    }
    epilogue();

#elif MODE == 3
    uvec4 x = uvec4(0);
    for (uint s = 0; s < steps; s++) {
        load_step(s);
        [[unroll]] for (uint i = 0; i < A_WORDS; i++) {
            x ^= ra[i];
        }
        [[unroll]] for (uint i = 0; i < B_WORDS; i++) {
            x ^= rb[i];
        }
    }
    sink(x);

#else
    // MODE 4: the GEMM's staging loop with the multiply-adds taken out.
#if STAGES == 2
    load_step(0);
    store_step(0);
    barrier();
    for (uint s = 0; s < steps; s++) {
        uint st = s & 1;
        if (s + 1 < steps) {
            load_step(s + 1);
            store_step(st ^ 1);
        }
        barrier();
    }
#else
    load_step(0);
    for (uint s = 0; s < steps; s++) {
        store_step(0);
        barrier();
        if (s + 1 < steps) {
            load_step(s + 1);
        }
        barrier();
    }
#endif
    sink(sa[gl_LocalInvocationIndex % SA_STAGE] ^ sb[gl_LocalInvocationIndex % SB_STAGE]);
#endif
}
