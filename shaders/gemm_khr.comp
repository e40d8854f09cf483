// The matrix-unit GEMM (MODE 0): compiled after gemm_khr_body.glsl
// (crates/glsl/build.rs joins them), which holds its configuration,
// staging and multiply-adds. The ceiling report's diagnostic parts are
// gemm_ceiling.comp.
#if MODE != 0
#error "gemm_khr.comp is the GEMM: MODE 0"
#endif

// Whether this invocation is one of the copying subgroups (WS), which
// hold no accumulators.
bool is_copier() {
    return WS != 0 && gl_LocalInvocationIndex >= MATH_THREADS;
}

// The main loop over the part's `steps` K steps, one per configuration:
// each leaves the accumulators holding the tile's sums.
#if FILTER
// The block filter: the loops below (#else), over the live steps only
// (next_live), counted by ordinal for the stages. Without FILTER none of
// this is compiled.
#if WS
// The copiers' own cursor `q` runs STAGES - 1 live steps ahead of the
// math's `s`, with its own mask window.
void main_loop(uint steps) {
    uvec2 cur = uvec2(0xffffffffu, 0u);
    uint s = next_live(0, steps, cur);
    bool copier = is_copier();
    uvec2 qcur = cur;
    uint q = s;
    if (copier) {
        for (uint t = 0; t + 1 < STAGES; t++) {
            if (q < steps) {
                load_step(q);
                store_step(t);
                q = next_live(q + 1, steps, qcur);
            }
        }
        if (q < steps) {
            load_step(q);
        }
    }
    barrier();
    for (uint i = 0; s < steps; i++) {
        if (copier) {
            // Ordinal i + STAGES - 1 (step q, in registers) to the stage
            // ordinal i - 1 used, then ordinal i + STAGES into registers.
            if (q < steps) {
                store_step((i + STAGES - 1) % STAGES);
                q = next_live(q + 1, steps, qcur);
                if (q < steps) {
                    load_step(q);
                }
            }
        } else {
            math_step(i % STAGES);
        }
        barrier();
        s = next_live(s + 1, steps, cur);
    }
}
#elif STAGES == 2
void main_loop(uint steps) {
    uvec2 cur = uvec2(0xffffffffu, 0u);
    uint s = next_live(0, steps, cur);
    if (s < steps) {
        load_step(s);
        store_step(0);
    }
    barrier();
    uint st = 0;
    while (s < steps) {
        uint nx = next_live(s + 1, steps, cur);
        if (nx < steps) {
            load_step(nx);
        }
#if INTERLEAVE
        math_slice(st, 0);
        if (nx < steps) {
            store_step(st ^ 1);
        }
        [[unroll]] for (uint kk = 16; kk < BK; kk += 16) {
            math_slice(st, kk);
        }
#else
        math_step(st);
        if (nx < steps) {
            store_step(st ^ 1);
        }
#endif
        barrier();
        s = nx;
        st ^= 1;
    }
}
#elif STAGES == 1
void main_loop(uint steps) {
    uvec2 cur = uvec2(0xffffffffu, 0u);
    uint s = next_live(0, steps, cur);
    if (s < steps) {
        load_step(s);
    }
    while (s < steps) {
        store_step(0);
        barrier();
        uint nx = next_live(s + 1, steps, cur);
        if (nx < steps) {
            load_step(nx);
        }
        math_step(0);
        barrier();
        s = nx;
    }
}
#else
#error "FILTER: one or two stages, or WS"
#endif

#elif WS
// Stages 0 .. STAGES - 2 filled before the loop; at step s the math
// subgroups read stage s % STAGES while the copiers store step
// s + STAGES - 1 into the stage step s - 1 used (free since the last
// barrier) and load step s + STAGES into registers.
void main_loop(uint steps) {
    bool copier = is_copier();
    if (copier) {
        for (uint t = 0; t + 1 < STAGES; t++) {
            if (t < steps) {
                load_step(t);
                store_step(t);
            }
        }
        if (STAGES - 1 < steps) {
            load_step(STAGES - 1);
        }
    }
    barrier();
    for (uint s = 0; s < steps; s++) {
        if (copier) {
            uint next = s + STAGES - 1;
            if (next < steps) {
                store_step(next % STAGES);
            }
            if (next + 1 < steps) {
                load_step(next + 1);
            }
        } else {
            math_step(s % STAGES);
        }
        barrier();
    }
}

#elif LOAD_KIND == 2
#if STAGES < 2
#error "LOAD_KIND 2 needs STAGES >= 2"
#endif
// Each step's words stored as soon as they are loaded, STAGES - 1 steps
// ahead through a ring: where the driver makes a load followed by its
// store one asynchronous copy, the copy runs under the math. Step
// s + STAGES - 1 goes to the stage step s - 1 read, free since the
// barrier that closed that step.
void main_loop(uint steps) {
    for (uint t = 0; t + 1 < STAGES; t++) {
        if (t < steps) {
            load_step(t);
            store_step(t);
        }
    }
    barrier();
    for (uint s = 0; s < steps; s++) {
        uint next = s + STAGES - 1;
        if (next < steps) {
            load_step(next);
            store_step(next % STAGES);
        }
        math_step(s % STAGES);
        barrier();
    }
}

#elif STAGES == 2
void main_loop(uint steps) {
    load_step(0);
    load_direct(0);
    store_step(0);
    advance_direct();
    barrier();
    for (uint s = 0; s < steps; s++) {
        uint st = s & 1;
        if (s + 1 < steps) {
            load_step(s + 1);
            load_direct(s + 1);
        }
#if INTERLEAVE
        math_slice(st, 0);
        if (s + 1 < steps) {
            store_step(st ^ 1);
        }
        [[unroll]] for (uint kk = 16; kk < BK; kk += 16) {
            math_slice(st, kk);
        }
#else
        math_step(st);
        if (s + 1 < steps) {
            store_step(st ^ 1);
        }
#endif
        STAGE_BARRIER();
        advance_direct();
    }
}

#else
void main_loop(uint steps) {
    load_step(0);
    load_direct(0);
    for (uint s = 0; s < steps; s++) {
        store_step(0);
        advance_direct();
        STAGE_BARRIER();
        if (s + 1 < steps) {
            load_step(s + 1);
            load_direct(s + 1);
        }
        math_step(0);
        STAGE_BARRIER();
    }
}
#endif

void main() {
    ENTER_TILE(p.k_parts, min(k0 + p.k_part, p.k) - k0);
    main_loop(steps);
    if (!is_copier()) {
        epilogue();
    }
}
