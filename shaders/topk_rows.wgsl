// The exact top-k row kernel (headkl_core::toolkit::TopkDesc): one workgroup per
// token row; a threshold from the invocations' largest keys (k <= 256) or a
// radix select over order-preserving keys, then a bitonic sort of the
// selected. See shaders/README.md.

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

// Rows are read 4 logits (16 bytes) at a time where it pays: ld is a
// multiple of 16.
@group(0) @binding(1) var<storage, read> logits: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> probs: array<f32>;

// Sorts after every real key: real keys of finite logits are never 0.
const PAD_KEY: u32 = 0u;
const PAD_ID: u32 = 0xffffffffu;

// Digit histogram: 11-bit digits.
var<workgroup> hist: array<atomic<u32>, TOPK_HIST>;
var<workgroup> scan: array<u32, WG>;
var<workgroup> sel_key: array<u32, MAX_K>;
var<workgroup> sel_id: array<u32, MAX_K>;
var<workgroup> gt_count: atomic<u32>;
var<workgroup> eq_count: atomic<u32>;
var<workgroup> bad_flag: atomic<u32>;
var<workgroup> more_flag: atomic<u32>;
// Values every invocation reads through workgroupUniformLoad.
var<workgroup> u_bad: u32;
var<workgroup> u_prefix: u32;
var<workgroup> u_need: u32;
var<workgroup> u_bucket: u32;
var<workgroup> u_total: u32;

// Logit `j` of the row starting at element `base` (a multiple of 4).
fn logit(base: u32, j: u32) -> f32 {
    return logits[(base + j) / 4u][j % 4u];
}

// Order-preserving u32 image of a finite f32 (-0 and +0 map to one key, so
// they tie like equal floats).
fn key_of(x: f32) -> u32 {
    var b = bitcast<u32>(x);
    if b == 0x80000000u {
        b = 0u;
    }
    if (b & 0x80000000u) != 0u {
        return ~b;
    }
    return b | 0x80000000u;
}

fn value_of(key: u32) -> f32 {
    if (key & 0x80000000u) != 0u {
        return bitcast<f32>(key & 0x7fffffffu);
    }
    return bitcast<f32>(~key);
}

fn non_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) >= 0x7f800000u;
}

// Inclusive prefix sum of scan[0..WG) (Hillis-Steele). Call from uniform
// control flow.
fn scan_inclusive(lid: u32) {
    for (var off = 1u; off < WG; off <<= 1u) {
        var v = scan[lid];
        if lid >= off {
            v += scan[lid - off];
        }
        workgroupBarrier();
        scan[lid] = v;
        workgroupBarrier();
    }
}

// Whether (ka, ia) comes before (kb, ib): key descending, id ascending.
fn before(ka: u32, ia: u32, kb: u32, ib: u32) -> bool {
    return ka > kb || (ka == kb && ia < ib);
}

// Sorts sel_key/sel_id[0..n) (n a power of two, at most MAX_K) by key
// descending, id ascending. Call from uniform control flow.
fn bitonic_sort(n: u32, lid: u32) {
    for (var size = 2u; size <= n; size <<= 1u) {
        for (var stride = size >> 1u; stride > 0u; stride >>= 1u) {
            for (var t = lid; t < n / 2u; t += WG) {
                let i = (t / stride) * stride * 2u + t % stride;
                let jj = i + stride;
                let ki = sel_key[i];
                let ii = sel_id[i];
                let kj = sel_key[jj];
                let ij = sel_id[jj];
                // Ascending blocks (in "before" order) when bit `size` of i is 0.
                let up = (i & size) == 0u;
                if before(kj, ij, ki, ii) == up {
                    sel_key[i] = kj;
                    sel_id[i] = ij;
                    sel_key[jj] = ki;
                    sel_id[jj] = ii;
                }
            }
            workgroupBarrier();
        }
    }
}

// Sorts the `count` selected pairs, padded to a power of two with pairs that
// sort last. Call from uniform control flow, after the pairs are written.
fn sort_selected(count: u32, lid: u32) {
    var n = 1u;
    while n < count {
        n <<= 1u;
    }
    for (var i = count + lid; i < n; i += WG) {
        sel_key[i] = PAD_KEY;
        sel_id[i] = PAD_ID;
    }
    workgroupBarrier();
    bitonic_sort(n, lid);
}

// Bits of params.flags (headkl_core::toolkit::params::row_flags; those of the KL
// rows come along, unused here).
// <row flags: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

// A value as written: cap·tanh(x/cap) with the softcap on (from
// e = exp(-2|x/cap|), which cannot overflow), else x.
fn capped(x: f32) -> f32 {
    if (params.flags & F_SOFTCAP) != 0u {
        let e = exp(-2.0 * abs(x / params.cap));
        return sign(x) * params.cap * ((1.0 - e) / (1.0 + e));
    }
    return x;
}

// Writes the first k sorted pairs of `row`: ids, and the softmax over the k
// relative to the largest (the first) — or, with F_LOGPROBS, the
// log-probabilities over the row's full vocabulary (one more pass).
fn write_row(row: u32, k: u32, lid: u32) {
    let top = capped(value_of(sel_key[0]));
    let full = (params.flags & F_LOGPROBS) != 0u;
    var part = 0.0;
    if full {
        let base = row * params.ld;
        for (var j = lid; j < params.vocab; j += WG) {
            part += exp(capped(logit(base, j)) - top);
        }
    } else {
        for (var q = lid; q < k; q += WG) {
            part += exp(capped(value_of(sel_key[q])) - top);
        }
    }
    // Reuse `scan` as f32 bits for the reduction.
    scan[lid] = bitcast<u32>(part);
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            scan[lid] = bitcast<u32>(bitcast<f32>(scan[lid]) + bitcast<f32>(scan[lid + s]));
        }
        workgroupBarrier();
    }
    let total = bitcast<f32>(scan[0]);
    let out = row * k;
    let log_total = log(total);
    for (var q = lid; q < k; q += WG) {
        ids[out + q] = sel_id[q];
        let d = capped(value_of(sel_key[q])) - top;
        if full {
            probs[out + q] = d - log_total;
        } else {
            probs[out + q] = exp(d) / total;
        }
    }
}

// F_GATHER: no selection. The log-probabilities over the full row at the
// caller's ids (the first k − 1 columns of `ids`; an id at or past vocab
// gets -inf) and the row's log-sum-exp in the last column; a row with a
// non-finite logit gets NaN in its first value (as write_bad). One read of
// the row, 16 bytes at a time, folding (max, Σ exp(u − max)) online.
struct GatherFold {
    m: f32,
    s: f32,
    bad: u32,
}

// Folds logit x when `live` (below vocab); a non-finite one only flags.
fn gather_fold(st: GatherFold, x: f32, live: bool) -> GatherFold {
    var out = st;
    if live {
        if non_finite(x) {
            out.bad = 1u;
        } else {
            let u = capped(x);
            if u > out.m {
                out.s = out.s * exp(out.m - u) + 1.0;
                out.m = u;
            } else {
                out.s += exp(u - out.m);
            }
        }
    }
    return out;
}

fn gather_row(row: u32, k: u32, lid: u32) {
    let base = row * params.ld;
    let vocab = params.vocab;
    let base4 = base / 4u;
    let n4 = (vocab + 3u) / 4u;
    // Straight-line over each word's four logits (no indexed component).
    var st = GatherFold(-3.0e38, 0.0, 0u);
    for (var j4 = lid; j4 < n4; j4 += WG) {
        let x4 = logits[base4 + j4];
        let j = j4 * 4u;
        st = gather_fold(st, x4.x, j < vocab);
        st = gather_fold(st, x4.y, j + 1u < vocab);
        st = gather_fold(st, x4.z, j + 2u < vocab);
        st = gather_fold(st, x4.w, j + 3u < vocab);
    }
    // The selection's arrays hold the merge (no selection runs here).
    sel_key[lid] = bitcast<u32>(st.m);
    sel_id[lid] = bitcast<u32>(st.s);
    scan[lid] = st.bad;
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h >>= 1u) {
        if lid < h {
            let m1 = bitcast<f32>(sel_key[lid]);
            let m2 = bitcast<f32>(sel_key[lid + h]);
            let m = max(m1, m2);
            let s = bitcast<f32>(sel_id[lid]) * exp(m1 - m) + bitcast<f32>(sel_id[lid + h]) * exp(m2 - m);
            sel_key[lid] = bitcast<u32>(m);
            sel_id[lid] = bitcast<u32>(s);
            scan[lid] |= scan[lid + h];
        }
        workgroupBarrier();
    }
    let lse = bitcast<f32>(sel_key[0]) + log(bitcast<f32>(sel_id[0]));
    let row_bad = scan[0];
    let out = row * k;
    for (var q = lid; q + 1u < k; q += WG) {
        let id = ids[out + q];
        var v = bitcast<f32>(0xff800000u);
        if id < vocab {
            v = capped(logit(base, id)) - lse;
        }
        probs[out + q] = v;
    }
    if lid == 0u {
        probs[out + k - 1u] = lse;
        if row_bad != 0u {
            probs[out] = bitcast<f32>(0x7fc00000u);
        }
    }
}

// An invocation's 4 largest keys so far, descending, with their ids, and
// whether it saw a non-finite logit.
struct Top4 {
    keys: vec4<u32>,
    ids: vec4<u32>,
    bad: bool,
}

// `t` with `(key, j)` kept if it is among the 4 largest. Ids rise as an
// invocation reads, so an equal key never displaces a kept one.
fn keep(t: Top4, key: u32, j: u32) -> Top4 {
    var r = t;
    if key > r.keys.w {
        if key > r.keys.z {
            r.keys.w = r.keys.z;
            r.ids.w = r.ids.z;
            if key > r.keys.y {
                r.keys.z = r.keys.y;
                r.ids.z = r.ids.y;
                if key > r.keys.x {
                    r.keys.y = r.keys.x;
                    r.ids.y = r.ids.x;
                    r.keys.x = key;
                    r.ids.x = j;
                } else {
                    r.keys.y = key;
                    r.ids.y = j;
                }
            } else {
                r.keys.z = key;
                r.ids.z = j;
            }
        } else {
            r.keys.w = key;
            r.ids.w = j;
        }
    }
    return r;
}

// `t` after the 4 logits of word `w` (`w < n4`; ids past `vocab` skipped).
fn keep4(t: Top4, x: vec4<f32>, w: u32, n4: u32, vocab: u32) -> Top4 {
    var r = t;
    if w < n4 {
        for (var c = 0u; c < 4u; c++) {
            let j = w * 4u + c;
            if j < vocab {
                if non_finite(x[c]) {
                    r.bad = true;
                }
                r = keep(r, key_of(x[c]), j);
            }
        }
    }
    return r;
}

// Marks `row` as holding a non-finite logit.
fn write_bad(row: u32, k: u32, lid: u32) {
    if lid == 0u {
        probs[row * k] = bitcast<f32>(0x7fc00000u);
    }
}

// Resets the row's counters and flags (invocation 0); the barrier lands
// them before any invocation can flag the row. Call from uniform control
// flow.
fn reset_row(k: u32, lid: u32) {
    if lid == 0u {
        u_prefix = 0u;
        u_need = k;
        atomicStore(&bad_flag, 0u);
        atomicStore(&more_flag, 0u);
        atomicStore(&gt_count, 0u);
        atomicStore(&eq_count, 0u);
    }
    workgroupBarrier();
}

// After a barrier: whether an invocation flagged the row (bad_flag), read
// uniformly; a flagged row is marked (write_bad). Call from uniform
// control flow.
fn flagged_bad(row: u32, k: u32, lid: u32) -> bool {
    if lid == 0u {
        u_bad = atomicLoad(&bad_flag);
    }
    if workgroupUniformLoad(&u_bad) != 0u {
        write_bad(row, k, lid);
        return true;
    }
    return false;
}

// gt_count once every invocation has added to it, read uniformly. Call
// from uniform control flow.
fn gt_total(lid: u32) -> u32 {
    workgroupBarrier();
    if lid == 0u {
        u_total = atomicLoad(&gt_count);
    }
    return workgroupUniformLoad(&u_total);
}

// The invocation's 4 largest keys over its strided share of the row (row
// words from base4), and whether it saw a non-finite logit. Four 16-byte
// loads in flight per invocation (one at a time left the read
// latency-bound), in named values: an indexed array of them went to slow
// local memory. Indices past the row repeat its last word; `keep4` skips
// them.
fn read_top4(base4: u32, lid: u32, vocab: u32) -> Top4 {
    var top = Top4(vec4<u32>(PAD_KEY), vec4<u32>(PAD_ID), false);
    let n4 = (vocab + 3u) / 4u;
    for (var j4 = lid; j4 < n4; j4 += 4u * WG) {
        let x0 = logits[base4 + j4];
        let x1 = logits[base4 + min(j4 + WG, n4 - 1u)];
        let x2 = logits[base4 + min(j4 + 2u * WG, n4 - 1u)];
        let x3 = logits[base4 + min(j4 + 3u * WG, n4 - 1u)];
        top = keep4(top, x0, j4, n4, vocab);
        top = keep4(top, x1, j4 + WG, n4, vocab);
        top = keep4(top, x2, j4 + 2u * WG, n4, vocab);
        top = keep4(top, x3, j4 + 3u * WG, n4, vocab);
    }
    return top;
}

// The invocation's kept keys >= T into sel_key/sel_id (one workgroup
// atomic each).
fn take_kept(top: Top4, threshold: u32) {
    for (var q = 0u; q < 4u; q++) {
        if top.keys[q] >= threshold {
            let slot = atomicAdd(&gt_count, 1u);
            sel_key[slot] = top.keys[q];
            sel_id[slot] = top.ids[q];
        }
    }
}

// A second read of the row: every key >= T into sel_key/sel_id (one
// workgroup atomic each; all counted, the first MAX_K stored).
fn gather_above(base4: u32, lid: u32, vocab: u32, threshold: u32) {
    for (var j4 = lid; j4 * 4u < vocab; j4 += WG) {
        let x4 = logits[base4 + j4];
        for (var c = 0u; c < 4u; c++) {
            let j = j4 * 4u + c;
            let key = key_of(x4[c]);
            if j < vocab && key >= threshold {
                let slot = atomicAdd(&gt_count, 1u);
                if slot < MAX_K {
                    sel_key[slot] = key;
                    sel_id[slot] = j;
                }
            }
        }
    }
}

// Threshold path (k <= WG): T, the k-th largest of the invocations'
// largest keys, is at most the row's k-th largest key (k invocations
// each own a key >= T), so the top k are among the keys >= T. Each
// invocation also keeps its 4 largest keys (id ascending among equal
// ones) while it reads: where every invocation's 4th is below T, those
// hold every key >= T and the row is read once. Otherwise a second read
// gathers the keys >= T, one atomic each. Returns whether the row is done
// (written, or marked bad); when more than MAX_K reach T (a flat row) it
// is not, and u_prefix and gt_count are reset for the radix select. Call
// from uniform control flow.
fn threshold_path(row: u32, k: u32, lid: u32) -> bool {
    let vocab = params.vocab;
    let base4 = row * params.ld / 4u;
    let top = read_top4(base4, lid, vocab);
    if top.bad {
        atomicStore(&bad_flag, 1u);
    }
    sel_key[lid] = top.keys.x;
    sel_id[lid] = lid;
    workgroupBarrier();
    if flagged_bad(row, k, lid) {
        return true;
    }
    bitonic_sort(WG, lid);
    if lid == 0u {
        u_prefix = sel_key[k - 1u];
    }
    let threshold = workgroupUniformLoad(&u_prefix);
    // An invocation whose 4th key reaches T may hold more keys >= T
    // than it kept.
    if top.keys.w >= threshold {
        atomicStore(&more_flag, 1u);
    }
    workgroupBarrier();
    if lid == 0u {
        u_total = atomicLoad(&more_flag);
    }
    if workgroupUniformLoad(&u_total) == 0u {
        take_kept(top, threshold);
        // At most 4 · WG = 1024 <= MAX_K pairs.
        sort_selected(gt_total(lid), lid);
        write_row(row, k, lid);
        return true;
    }
    gather_above(base4, lid, vocab, threshold);
    let count = gt_total(lid);
    if count <= MAX_K {
        sort_selected(count, lid);
        write_row(row, k, lid);
        return true;
    }
    if lid == 0u {
        u_prefix = 0u;
        atomicStore(&gt_count, 0u);
    }
    workgroupBarrier();
    return false;
}

// The radix select's state: after a pass, `prefix` holds the k-th largest
// key's bits resolved so far (under `mask`) and `need` how many keys with
// that prefix are still to be taken (1 ≤ need ≤ bucket, the keys with
// that prefix); `bad`: the row holds a non-finite logit (and is marked).
struct Radix {
    mask: u32,
    prefix: u32,
    need: u32,
    bucket: u32,
    bad: bool,
}

// One pass's histogram: cleared, then the digit (key >> shift) &
// digit_mask of every key of the row (from element base) with the
// resolved prefix counted; with `first`, a non-finite logit flags the row
// (bad_flag). Ends with a barrier. Call from uniform control flow.
fn count_digits(base: u32, lid: u32, r: Radix, shift: u32, digit_mask: u32, first: bool) {
    for (var i = lid; i < TOPK_HIST; i += WG) {
        atomicStore(&hist[i], 0u);
    }
    workgroupBarrier();
    var bad = false;
    for (var j = lid; j < params.vocab; j += WG) {
        let x = logit(base, j);
        if first && non_finite(x) {
            bad = true;
        }
        let key = key_of(x);
        if (key & r.mask) == r.prefix {
            atomicAdd(&hist[(key >> shift) & digit_mask], 1u);
        }
    }
    if bad {
        atomicStore(&bad_flag, 1u);
    }
    workgroupBarrier();
}

// The digit of the need-th largest key with the resolved prefix:
// invocation t owns digits [t·per, (t+1)·per), and the scan over
// invocations in reverse order counts the keys above its digits; the
// invocation holding it sets u_prefix, u_need and u_bucket. Call from
// uniform control flow.
fn find_digit(lid: u32, bins: u32, shift: u32, prefix: u32, need: u32) {
    let per = bins / WG;
    var own = 0u;
    for (var d = lid * per; d < (lid + 1u) * per; d++) {
        own += atomicLoad(&hist[d]);
    }
    scan[WG - 1u - lid] = own;
    workgroupBarrier();
    scan_inclusive(lid);
    var above = scan[WG - 1u - lid] - own;
    for (var i = 0u; i < per; i++) {
        let d = (lid + 1u) * per - 1u - i;
        let h = atomicLoad(&hist[d]);
        if above < need && need <= above + h {
            u_prefix = prefix | (d << shift);
            u_need = need - above;
            u_bucket = h;
        }
        above += h;
    }
}

// Radix select: the k-th largest key in 3 digits of 11, 11 and 10 bits,
// stopping early when a whole digit bucket is taken. Call from uniform
// control flow.
fn radix_select(row: u32, k: u32, lid: u32) -> Radix {
    let base = row * params.ld;
    var r = Radix(0u, 0u, k, 0u, false);
    for (var digit_pass = 0u; digit_pass < 3u; digit_pass++) {
        var shift = 21u - 11u * digit_pass;
        var bins = TOPK_HIST;
        if digit_pass == 2u {
            shift = 0u;
            bins = TOPK_HIST / 2u;
        }
        let digit_mask = bins - 1u;
        count_digits(base, lid, r, shift, digit_mask, digit_pass == 0u);
        if digit_pass == 0u {
            if flagged_bad(row, k, lid) {
                r.bad = true;
                return r;
            }
        }
        find_digit(lid, bins, shift, r.prefix, r.need);
        r.prefix = workgroupUniformLoad(&u_prefix);
        r.need = workgroupUniformLoad(&u_need);
        r.bucket = workgroupUniformLoad(&u_bucket);
        r.mask |= digit_mask << shift;
        if r.need == r.bucket {
            // Every key in the bucket is taken: no tie to break below.
            break;
        }
    }
    return r;
}

// Gather: keys above the bucket anywhere, and the bucket's keys when all
// of them are taken (after the k − need keys above).
fn gather_selected(row: u32, k: u32, lid: u32, r: Radix) {
    let base = row * params.ld;
    let take_all = r.need == r.bucket;
    let n_gt = k - r.need;
    for (var j = lid; j < params.vocab; j += WG) {
        let key = key_of(logit(base, j));
        let hi = key & r.mask;
        if hi > r.prefix {
            let slot = atomicAdd(&gt_count, 1u);
            sel_key[slot] = key;
            sel_id[slot] = j;
        } else if take_all && hi == r.prefix {
            let slot = n_gt + atomicAdd(&eq_count, 1u);
            sel_key[slot] = key;
            sel_id[slot] = j;
        }
    }
}

// All 32 bits were resolved: the bucket is the keys equal to the k-th
// largest. Takes the `need` lowest ids among them, tile by tile in id
// order, after the k − need keys above. Call from uniform control flow.
fn take_ties(row: u32, k: u32, lid: u32, r: Radix) {
    let base = row * params.ld;
    let vocab = params.vocab;
    let n_gt = k - r.need;
    var taken = 0u;
    for (var tile = 0u; tile < vocab; tile += WG) {
        let j = tile + lid;
        var hit = 0u;
        var key = 0u;
        if j < vocab {
            key = key_of(logit(base, j));
            if key == r.prefix {
                hit = 1u;
            }
        }
        workgroupBarrier();
        scan[lid] = hit;
        workgroupBarrier();
        scan_inclusive(lid);
        let before_me = taken + scan[lid] - hit;
        if hit == 1u && before_me < r.need {
            sel_key[n_gt + before_me] = key;
            sel_id[n_gt + before_me] = j;
        }
        if lid == WG - 1u {
            u_total = scan[lid];
        }
        taken += workgroupUniformLoad(&u_total);
        if taken >= r.need {
            break;
        }
    }
}

@compute @workgroup_size(WG)
fn topk_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.x + wg.y * params.grid_x;
    if row >= params.rows {
        return;
    }
    if (params.flags & F_GATHER) != 0u {
        gather_row(row, params.k, lid);
        return;
    }
    let k = params.k;
    reset_row(k, lid);
    if k <= WG {
        if threshold_path(row, k, lid) {
            return;
        }
    }
    let r = radix_select(row, k, lid);
    if r.bad {
        return;
    }
    gather_selected(row, k, lid, r);
    if r.need != r.bucket {
        take_ties(row, k, lid, r);
    }
    sort_selected(k, lid);
    write_row(row, k, lid);
}
