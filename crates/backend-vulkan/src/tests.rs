//! Plumbing tests with the crate's own tiny kernels, and the check that every
//! shared shader (the cooperative-matrix GEMM included) compiles to SPIR-V.

use headkl_core::{Backend, DeviceBuffer, GemmChoice};

use headkl_conformance::{gemm_choice_outcome, harness_env, open_or_skip};
use headkl_core::toolkit::{GemmKernel, KernelId, KernelSource};
use naga::back::spv::Capability;

use crate::pipeline::{compile, parse, PipelineKey, ShaderSource, ShaderTarget};
use crate::{CopyQueue, VulkanBackend, VulkanOptions};

/// Opens the default device with validation and a staging buffer of
/// `staging` bytes; `None` (after saying why) when there is no device and
/// the backend is not required.
fn open(staging: u64) -> Option<VulkanBackend> {
    open_copies(staging, None)
}

/// [`open`] with the copies where `copies` says (`None`: as the
/// environment says).
fn open_copies(staging: u64, copies: Option<CopyQueue>) -> Option<VulkanBackend> {
    let from_env = VulkanOptions::from_env(&harness_env()).expect("a HEADKL_* setting does not parse");
    let options = VulkanOptions {
        validation: true,
        copy_queue: copies.unwrap_or(from_env.copy_queue),
        ..from_env
    };
    open_or_skip("vulkan", || VulkanBackend::open_inner(&options, staging))
}

/// [`open`] with every copy in line on the kernels' queue: the ring's
/// own tests count its submissions.
fn open_in_line() -> Option<VulkanBackend> {
    open_copies(crate::command::STAGING_BYTES, Some(CopyQueue::Off))
}

/// `dst[i] = f16(src[i] · scale)` over a folded grid of `WG`-wide groups.
const SCALE: ShaderSource = ShaderSource {
    file: "test_scale.wgsl",
    // Declares its own parameters (no marker): `params` goes unused.
    params: headkl_core::toolkit::params::RowParams::BLOCK,
    text: r#"
enable f16;
struct P { n: u32, scale: f32, grid_x: u32, pad: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f16>;
override WG: u32 = 64u;
@compute @workgroup_size(WG)
fn scale_f16(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * p.grid_x) * WG + lid;
    if i >= p.n { return; }
    dst[i] = f16(src[i] * p.scale);
}
"#,
};

/// `x[i] += p.add` for `i < n` (one invocation per element, 64 wide).
const ADD: ShaderSource = ShaderSource {
    file: "test_add.wgsl",
    params: headkl_core::toolkit::params::RowParams::BLOCK,
    text: r#"
struct P { n: u32, add: f32, grid_x: u32, pad: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn add(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.x + wg.y * p.grid_x) * 64u + lid;
    if i >= p.n { return; }
    x[i] = x[i] + p.add;
}
"#,
};

fn key(source: &ShaderSource, entry: &'static str, overrides: Vec<(&'static str, u32)>) -> PipelineKey {
    PipelineKey {
        file: source.file,
        entry,
        overrides,
        checked: true,
        full_subgroups: false,
        required_subgroup_size: None,
    }
}

fn params(words: [u32; 4]) -> impl FnOnce(u32) -> Vec<u8> {
    move |grid_x| {
        let mut w = words;
        w[2] = grid_x;
        bytemuck::cast_slice(&w).to_vec()
    }
}

/// Records `x[i] += v` on the first `n` floats of `x` (the test kernel),
/// timed as `label`.
fn add(b: &VulkanBackend, x: &crate::VulkanBuffer, n: u64, v: f32, label: &'static str) -> headkl_core::Result<()> {
    b.dispatch(
        &ADD,
        key(&ADD, "add", Vec::new()),
        n.div_ceil(64),
        params([n as u32, v.to_bits(), 0, 0]),
        &[x],
        label,
    )
}

fn assert_clean(b: &VulkanBackend) {
    let d = b.take_diagnostics();
    assert!(d.is_empty(), "validation messages:\n{}", d.join("\n"));
}

#[test]
fn own_kernel_with_overrides_and_a_folded_grid() {
    let Some(b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    // More than 65535 workgroups of 64: the grid folds into (x, y).
    let n: usize = 65_535 * 64 + 1000;
    let src: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.25 - 100.0).collect();
    let src_buf = b.alloc((n * 4) as u64, "src").unwrap();
    let dst_buf = b.alloc((n * 2) as u64, "dst").unwrap();
    b.upload(&src_buf, 0, bytemuck::cast_slice(&src)).unwrap();
    for wg in [64u32, 128] {
        b.upload(&dst_buf, 0, &vec![0xff; n * 2]).unwrap(); // NaN poison
        let count = (n as u64).div_ceil(u64::from(wg));
        let scale = 0.5f32;
        b.dispatch(
            &SCALE,
            key(&SCALE, "scale_f16", vec![("WG", wg)]),
            count,
            params([n as u32, scale.to_bits(), 0, 0]),
            &[&src_buf, &dst_buf],
            "test_scale",
        )
        .unwrap();
        let mut out = vec![half::f16::ZERO; n];
        b.download(&dst_buf, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
        for (i, (&o, &s)) in out.iter().zip(&src).enumerate() {
            assert_eq!(o, half::f16::from_f32(s * scale), "WG={wg}: element {i}");
        }
    }
    assert_eq!(b.pipelines.lock().unwrap().len(), 2, "one pipeline per override value");
    assert_clean(&b);
}

#[test]
fn dependent_dispatches_and_ordered_uploads() {
    let Some(b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    let n = 5000usize;
    let x = b.alloc((n * 4) as u64, "x").unwrap();
    b.upload(&x, 0, bytemuck::cast_slice(&vec![1.0f32; n])).unwrap();
    let run = |v: f32| add(&b, &x, n as u64, v, "test_add").unwrap();
    // Each dispatch reads the previous one's result.
    for _ in 0..3 {
        run(2.0);
    }
    // This upload must land after the three dispatches, and before the next.
    b.upload(&x, 40, bytemuck::cast_slice(&[100.0f32; 10])).unwrap();
    run(1.0);
    let mut out = vec![0f32; n];
    b.download(&x, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    for (i, &v) in out.iter().enumerate() {
        let want = if (10..20).contains(&i) { 101.0 } else { 8.0 };
        assert_eq!(v, want, "element {i}");
    }
    assert_clean(&b);
}

#[test]
fn piecewise_transfers_through_a_small_staging_buffer() {
    let Some(b) = open(1 << 20) else { return };
    let bytes = (3 << 20) + 4 * 1234;
    let data: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251) as u8).collect();
    let buf = b.alloc(bytes as u64 + 64, "big").unwrap();
    b.upload(&buf, 16, &data).unwrap();
    // Several small uploads that share the staging buffer before a flush.
    for j in 0..300u64 {
        b.upload(&buf, 16 + j * 4096, &[j as u8; 8]).unwrap();
    }
    let mut out = vec![0u8; bytes];
    b.download(&buf, 16, &mut out).unwrap();
    let mut want = data.clone();
    for j in 0..300usize {
        want[j * 4096..j * 4096 + 8].fill(j as u8);
    }
    assert!(out == want, "round trip through 1 MiB pieces differs");
    let mut tail = vec![0u8; 100];
    b.download(&buf, 16 + bytes as u64 - 100, &mut tail).unwrap();
    assert_eq!(tail, want[bytes - 100..]);
    // Out of range is an error, not a crash.
    assert!(b.upload(&buf, bytes as u64, &[0u8; 100]).is_err());
    assert_clean(&b);
}

#[test]
fn buffers_dropped_while_work_is_pending_are_freed_later() {
    let Some(b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    let before = b.memory().current;
    let n = 1 << 16;
    {
        let x = b.alloc(n * 4, "x").unwrap();
        add(&b, &x, n, 1.0, "test_add").unwrap();
        assert!(b.memory().current >= before + n * 4);
        // `x` drops here while the dispatch is recorded but not run.
    }
    b.finish().unwrap();
    assert_eq!(b.memory().current, before, "freed after the wait");
    // A buffer may outlive its backend.
    let survivor = b.alloc(1024, "survivor").unwrap();
    assert_clean(&b);
    let diagnostics = std::sync::Arc::clone(&b.device.instance.diagnostics);
    drop(b);
    assert_eq!(survivor.len(), 1024);
    drop(survivor);
    // The device is destroyed now; the layer reports leaked objects there.
    let late = diagnostics.take();
    assert!(late.is_empty(), "at device destruction:\n{}", late.join("\n"));
}

#[test]
fn two_submissions_in_flight_at_once() {
    let Some(b) = open_in_line() else {
        return;
    };
    let timed = b.set_profiling(true);
    let n = 1u64 << 16;
    let add = |x: &crate::VulkanBuffer, v: f32, label: &'static str| add(&b, x, n, v, label).unwrap();
    let submissions = || b.stream().unwrap().submissions();
    let before = b.memory().current;
    let x = b.alloc(n * 4, "x").unwrap();
    let y = b.alloc(n * 4, "y").unwrap();
    let z = b.alloc(n * 4, "z").unwrap();
    b.upload(&x, 0, bytemuck::cast_slice(&vec![1.0f32; n as usize]))
        .unwrap();
    add(&x, 2.0, "first");
    add(&z, 1.0, "first");
    b.stream().unwrap().submit().unwrap();
    assert_eq!(submissions(), (1, 0), "the first submission in flight");
    // The next recording (an upload through the other slot's staging, and
    // a dispatch reading what the first submission writes) does not wait.
    b.upload(&y, 0, bytemuck::cast_slice(&vec![2.0f32; n as usize]))
        .unwrap();
    add(&x, 3.0, "second");
    add(&y, 1.0, "second");
    b.stream().unwrap().submit().unwrap();
    assert_eq!(submissions(), (2, 0), "two submissions in flight, none waited for");
    // `z` drops while the submission that uses it may run: parked.
    drop(z);
    assert_eq!(b.memory().current, before + 3 * n * 4, "z parked while in flight");
    // A third recording reuses the first slot: it waits for the first
    // submission only.
    add(&y, 4.0, "third");
    assert_eq!(submissions(), (1, 1), "the third recording waited for the first only");
    let mut out = vec![0f32; n as usize];
    b.download(&x, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    assert!(out.iter().all(|&v| v == 6.0), "x: 1 + 2 + 3 across two submissions");
    assert_eq!(submissions(), (0, 3), "the download waited for everything");
    assert_eq!(b.memory().current, before + 2 * n * 4, "z freed after the wait");
    b.download(&y, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    assert!(out.iter().all(|&v| v == 7.0), "y: 2 + 1 + 4");
    if timed {
        let labels: Vec<&str> = b.take_kernel_times().unwrap().iter().map(|t| t.kernel).collect();
        assert_eq!(
            labels,
            ["first", "first", "second", "second", "third"],
            "in submission order"
        );
    } else {
        eprintln!("this queue has no timestamps: kernel-time order not checked");
    }
    drop((x, y));
    assert_eq!(b.memory().current, before);
    assert_clean(&b);
}

/// A seeded pseudo-random value in `[-1, 1)` for element `i`.
fn noise(seed: u64, i: usize) -> f32 {
    let mut z = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

#[test]
fn host_path_records_each_chunk_while_the_previous_one_runs() {
    use headkl_core::{
        Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, SliceOptions, Teacher, TopkOptions,
    };
    let Some(b) = open_in_line() else {
        return;
    };
    let (vocab, hs, ntok, k) = (512, 64, 96, 4);
    let w: Vec<f32> = (0..vocab * hs).map(|i| noise(1, i) * 0.5).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| noise(2, i)).collect();
    let ids: Vec<u32> = (0..ntok * k).map(|i| ((i * 37 + i / k * 11) % vocab) as u32).collect();
    let probs: Vec<f32> = (0..ntok * k).map(|i| 1.0 + (i % k) as f32).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let hidden = Hidden::f32(&x, ntok, hs).unwrap();
    let teacher = Teacher::new(&ids, &probs, ntok, k, vocab).unwrap();
    let mut engine = Engine::new(&b, &head, SliceOptions::default()).unwrap();
    let reset = || std::mem::take(&mut b.stream().unwrap().ring_stats);
    // Six chunks of 16 rows.
    let loss_opts = LossOptions::from(LossConfig {
        max_rows_per_chunk: Some(16),
        ..LossConfig::default()
    });
    let topk_opts = TopkOptions {
        max_rows_per_chunk: Some(16),
        ..TopkOptions::new(k)
    };
    // A first call of each builds the pipelines and scratch.
    engine.head_kl(&hidden, &teacher, &loss_opts).unwrap();
    engine.topk(&hidden, &topk_opts).unwrap();
    reset();
    let out = engine.head_kl(&hidden, &teacher, &loss_opts).unwrap();
    let stats = reset();
    assert!(out.loss.iter().all(|l| l.is_finite() && *l >= 0.0), "head_kl losses");
    assert_eq!(
        stats.most_in_flight, 2,
        "head_kl: two submissions in flight ({stats:?})"
    );
    assert_eq!(
        stats.begin_waits, 0,
        "head_kl: a recording waited for its slot ({stats:?})"
    );
    // The first chunk is submitted when the second starts, not with it.
    assert_eq!(stats.submits, 6, "head_kl: one submission per chunk ({stats:?})");
    let top = engine.topk(&hidden, &topk_opts).unwrap();
    let stats = reset();
    assert_eq!(stats.most_in_flight, 2, "topk: two submissions in flight ({stats:?})");
    assert_eq!(
        stats.begin_waits, 0,
        "topk: a recording waited for its slot ({stats:?})"
    );
    assert_eq!(stats.submits, 6, "topk: one submission per chunk ({stats:?})");
    let want = headkl_reference::direct::topk_f64(&head, &hidden, k, 1.0);
    headkl_reference::Tolerance::default()
        .check_topk(&top.ids, &top.probs, &want)
        .unwrap();
    assert_clean(&b);
}

/// head_kl and topk through the host path, f32 and f16 hidden rows, over
/// six chunks: every chunk's hidden rows go up and its dx comes down on the
/// copy lanes (here on the kernels' own queue, which every device has),
/// and the outputs equal the in-line path's bit for bit (the same kernels;
/// only the synchronization differs). The second call of each reuses the
/// scratch the first one's copies touched.
#[test]
fn host_path_copies_on_lanes_match_the_in_line_path() {
    use headkl_core::{
        Engine, HeadData, HeadWeights, Hidden, LossConfig, LossOptions, SliceOptions, Teacher, TopkOptions,
    };
    let Some(lanes) = open_copies(crate::command::STAGING_BYTES, Some(CopyQueue::Compute)) else {
        return;
    };
    let Some(in_line) = open_in_line() else {
        return;
    };
    if !lanes.stream().unwrap().has_lanes() {
        eprintln!(
            "{}: no timeline semaphores, no copy lanes: not checked",
            lanes.info.device_name
        );
        return;
    }
    assert!(lanes.transfers_overlap() && !in_line.transfers_overlap());
    let (vocab, hs, ntok, k, chunks) = (512, 64, 96, 4, 6);
    let w: Vec<f32> = (0..vocab * hs).map(|i| noise(21, i) * 0.5).collect();
    let x: Vec<f32> = (0..ntok * hs).map(|i| noise(22, i)).collect();
    let x16: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
    let ids: Vec<u32> = (0..ntok * k).map(|i| ((i * 37 + i / k * 11) % vocab) as u32).collect();
    let probs: Vec<f32> = (0..ntok * k).map(|i| 1.0 + (i % k) as f32).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let teacher = Teacher::new(&ids, &probs, ntok, k, vocab).unwrap();
    let loss_opts = LossOptions::from(LossConfig {
        max_rows_per_chunk: Some(ntok / chunks),
        ..LossConfig::default()
    });
    let topk_opts = TopkOptions {
        max_rows_per_chunk: Some(ntok / chunks),
        ..TopkOptions::new(k)
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for hidden in [Hidden::f32(&x, ntok, hs).unwrap(), Hidden::f16(&x16, ntok, hs).unwrap()] {
        let run = |b: &VulkanBackend| {
            let mut engine = Engine::new(b, &head, SliceOptions::default()).unwrap();
            std::mem::take(&mut b.stream().unwrap().ring_stats);
            let first = engine.head_kl(&hidden, &teacher, &loss_opts).unwrap();
            let second = engine.head_kl(&hidden, &teacher, &loss_opts).unwrap();
            let top = [0, 1].map(|_| engine.topk(&hidden, &topk_opts).unwrap());
            let stats = std::mem::take(&mut b.stream().unwrap().ring_stats);
            (first, second, top, stats)
        };
        let (first, second, top, stats) = run(&lanes);
        let (want, _, want_top, _) = run(&in_line);
        for (got, call) in [(&first, "first"), (&second, "second")] {
            assert_eq!(bits(&got.dx), bits(&want.dx), "{call} head_kl: dx");
            assert_eq!(bits(&got.loss), bits(&want.loss), "{call} head_kl: loss");
        }
        for (got, call) in top.iter().zip(["first", "second"]) {
            assert_eq!(got.ids, want_top[0].ids, "{call} topk: ids");
            assert_eq!(bits(&got.probs), bits(&want_top[0].probs), "{call} topk: probs");
        }
        // Per chunk, at least the hidden rows' upload (four calls) and dx's
        // download (two head_kl calls) went on the lanes.
        assert!(
            stats.lane_submits >= 4 * chunks + 2 * chunks,
            "copies on the lanes ({stats:?})"
        );
        assert!(stats.submits <= 4 * 2 * chunks, "kernels' submissions ({stats:?})");
    }
    assert_clean(&lanes);
    assert_clean(&in_line);
}

/// The copy lanes' hazards one at a time, on plain buffers: an upload into
/// an idle buffer goes on the lane and the kernels that read it wait for
/// it; one into a buffer the recording uses stays in line; a download
/// waits for the kernels that wrote its source; and kernels that write a
/// buffer wait for the download reading it.
#[test]
fn lane_copies_wait_for_what_touched_their_buffer() {
    let Some(b) = open_copies(crate::command::STAGING_BYTES, Some(CopyQueue::Compute)) else {
        return;
    };
    if !b.stream().unwrap().has_lanes() {
        eprintln!(
            "{}: no timeline semaphores, no copy lanes: not checked",
            b.info.device_name
        );
        return;
    }
    let n = 1u64 << 16;
    let filled = |v: f32| vec![v; n as usize];
    let x = b.alloc(n * 4, "x").unwrap();
    let stats = || std::mem::take(&mut b.stream().unwrap().ring_stats);
    stats();
    b.upload(&x, 0, bytemuck::cast_slice(&filled(1.0))).unwrap();
    assert_eq!(
        stats().lane_submits,
        1,
        "an upload into an idle buffer goes on the lane"
    );
    add(&b, &x, n, 2.0, "after the lane's upload").unwrap();
    b.upload(&x, 0, bytemuck::cast_slice(&filled(5.0))).unwrap();
    assert_eq!(
        stats().lane_submits,
        0,
        "an upload into a buffer the recording uses stays in line"
    );
    add(&b, &x, n, 1.0, "after the in-line upload").unwrap();
    let pending = b.download_begin(&x, 0, (n * 4) as usize).unwrap();
    add(&b, &x, n, 10.0, "after the download began").unwrap();
    let s = stats();
    assert_eq!(s.lane_submits, 1, "the download went on its lane ({s:?})");
    let mut out = filled(0.0);
    b.download_end(pending, bytemuck::cast_slice_mut(&mut out)).unwrap();
    assert!(
        out.iter().all(|&v| v == 6.0),
        "the download saw 5 + 1, not the later add"
    );
    b.download(&x, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    assert!(out.iter().all(|&v| v == 16.0), "x: 5 + 1 + 10");
    // The upload lane's first copy was read by the first add: 1 + 2 is
    // overwritten by the in-line upload, so check that ordering too.
    let y = b.alloc(n * 4, "y").unwrap();
    b.upload(&y, 0, bytemuck::cast_slice(&filled(1.0))).unwrap();
    add(&b, &y, n, 2.0, "after the lane's upload").unwrap();
    b.download(&y, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    assert!(out.iter().all(|&v| v == 3.0), "y: the add read the lane's upload");
    assert_clean(&b);
}

#[test]
fn resident_calls_do_not_wait_for_the_previous_one() {
    use headkl_core::{DeviceHidden, Engine, HeadData, HeadWeights, Hidden, HiddenDtype, SliceOptions, TopkOptions};
    let Some(b) = open_in_line() else {
        return;
    };
    let (vocab, hs, ntok, k) = (512, 64, 48, 4);
    let w: Vec<f32> = (0..vocab * hs).map(|i| noise(3, i) * 0.5).collect();
    let head = HeadWeights::new(HeadData::F32(&w), vocab, hs).unwrap();
    let mut engine = Engine::new(&b, &head, SliceOptions::default()).unwrap();
    let opts = TopkOptions::new(k);
    let inputs: Vec<Vec<f32>> = (0..3u64)
        .map(|c| (0..ntok * hs).map(|i| noise(10 + c, i)).collect())
        .collect();
    let mut outputs = Vec::new();
    for x in &inputs {
        let hidden = b.alloc((ntok * hs * 4) as u64, "hidden").unwrap();
        b.upload(&hidden, 0, bytemuck::cast_slice(x)).unwrap();
        let ids = b.alloc((ntok * k * 4) as u64, "ids").unwrap();
        let probs = b.alloc((ntok * k * 4) as u64, "probs").unwrap();
        outputs.push((hidden, ids, probs));
    }
    // A first call builds the pipelines and scratch.
    let device_topk = |engine: &mut Engine<&VulkanBackend>, (hidden, ids, probs): &(_, _, _)| {
        let hidden = DeviceHidden {
            buffer: hidden,
            dtype: HiddenDtype::F32,
        };
        engine.topk_device(ntok, &hidden, ids, probs, &opts).unwrap();
    };
    device_topk(&mut engine, &outputs[0]);
    engine.wait_device().unwrap();
    std::mem::take(&mut b.stream().unwrap().ring_stats);
    for o in &outputs {
        device_topk(&mut engine, o);
    }
    let stats = std::mem::take(&mut b.stream().unwrap().ring_stats);
    assert_eq!(stats.most_in_flight, 2, "two resident calls in flight ({stats:?})");
    assert_eq!(
        stats.begin_waits, 1,
        "only the third call waited, for the first ({stats:?})"
    );
    engine.wait_device().unwrap();
    for (x, (_, ids, probs)) in inputs.iter().zip(&outputs) {
        let (mut got_ids, mut got_probs) = (vec![0u32; ntok * k], vec![0f32; ntok * k]);
        b.download(ids, 0, bytemuck::cast_slice_mut(&mut got_ids)).unwrap();
        b.download(probs, 0, bytemuck::cast_slice_mut(&mut got_probs)).unwrap();
        let want = headkl_reference::direct::topk_f64(&head, &Hidden::f32(x, ntok, hs).unwrap(), k, 1.0);
        headkl_reference::Tolerance::default()
            .check_topk(&got_ids, &got_probs, &want)
            .unwrap();
    }
    assert_clean(&b);
}

#[test]
fn exported_buffers_and_the_shared_timeline_order_the_work() {
    let Some(b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    if let Err(e) = b.interop() {
        // A device without the extensions says which; nothing else runs.
        let why = e.to_string();
        assert!(why.contains("cannot share memory with CUDA"), "{why}");
        eprintln!("interop not tested on this device: {why}");
        return;
    }
    let n = 3000usize;
    let exported = b.export_buffer((n * 4) as u64, "shared").unwrap();
    assert!(exported.allocation_bytes >= (n * 4) as u64);
    let memory_fd = std::fs::File::from(exported.fd);
    let timeline_fd = std::fs::File::from(b.export_timeline().unwrap());
    for fd in [&memory_fd, &timeline_fd] {
        fd.metadata().expect("an exported fd is open");
    }
    let x = exported.buffer;
    b.upload(&x, 0, bytemuck::cast_slice(&vec![1.0f32; n])).unwrap();
    // What another API would do: signal 1 once the inputs are in; headkl's
    // next submission waits for it and signals 2 when done.
    b.signal_timeline(1).unwrap();
    b.wait_timeline(1).unwrap();
    add(&b, &x, n as u64, 2.0, "test_add").unwrap();
    b.signal_timeline(2).unwrap();
    b.finish().unwrap();
    assert_eq!(b.stream().unwrap().shared_value(), 2);
    let mut out = vec![0f32; n];
    b.download(&x, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    assert!(out.iter().all(|&v| v == 3.0));
    assert_clean(&b);
}

#[test]
fn dropping_the_backend_with_two_submissions_in_flight_waits_for_both() {
    let Some(b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    let n = 1u64 << 18;
    let x = b.alloc(n * 4, "x").unwrap();
    for _ in 0..2 {
        b.upload(&x, 0, &vec![0u8; (n * 4) as usize]).unwrap();
        add(&b, &x, n, 1.0, "test_add").unwrap();
        b.stream().unwrap().submit().unwrap();
    }
    assert_eq!(b.stream().unwrap().submissions(), (2, 0));
    assert_clean(&b);
    let diagnostics = std::sync::Arc::clone(&b.device.instance.diagnostics);
    // The backend goes first while both submissions (and `x`) may run.
    drop(b);
    drop(x);
    let late = diagnostics.take();
    assert!(late.is_empty(), "at teardown:\n{}", late.join("\n"));
}

#[test]
fn kernel_times_are_labelled() {
    let Some(b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    if !b.set_profiling(true) {
        assert_eq!(
            b.device.timestamp_valid_bits(),
            0,
            "timing refused on a queue with timestamps"
        );
        eprintln!("SKIPPED: this queue has no timestamps");
        return;
    }
    let n = 1u64 << 18;
    let x = b.alloc(n * 4, "x").unwrap();
    for _ in 0..3 {
        add(&b, &x, n, 1.0, "test_add").unwrap();
    }
    b.finish().unwrap();
    let times = b.take_kernel_times().unwrap();
    assert_eq!(times.len(), 3);
    assert!(times
        .iter()
        .all(|t| t.kernel == "test_add" && t.ms >= 0.0 && t.ms < 10_000.0));
    assert!(b.take_kernel_times().unwrap().is_empty(), "taken once");
    assert!(b.set_profiling(false));
    assert_clean(&b);
}

/// The capabilities a SPIR-V module declares and its memory model (1:
/// GLSL450, 3: Vulkan).
fn spirv_declarations(words: &[u32]) -> (Vec<Capability>, u32) {
    let found = headkl_glsl::interface(words).expect("well-formed SPIR-V");
    let caps = found
        .capabilities
        .iter()
        .filter_map(|&c| Capability::from_u32(c))
        .collect();
    (caps, found.memory_model)
}

/// Compiles every build of every kernel in the catalogue (each GEMM family,
/// every matrix-unit tile `headkl tune` may pick at three subgroup sizes),
/// checked and unchecked, for a device with every feature (the H200's
/// set): CI's only check that the matrix-unit GEMM compiles as this backend
/// builds it, since lavapipe has no matrix units.
#[test]
fn every_catalogue_kernel_compiles_to_spirv() {
    let target = ShaderTarget::everything();
    let mut gemms = vec![GemmKernel::Tiled];
    for kernel in headkl_core::toolkit::CoopGemm::candidates() {
        match kernel {
            // Written for subgroups of 32 only.
            headkl_core::toolkit::CoopGemm::Glsl(_) | headkl_core::toolkit::CoopGemm::Wgmma(_) => {
                gemms.push(GemmKernel::Coop { kernel, subgroup: 32 })
            }
            _ => gemms.extend([32u32, 64, 16].map(|subgroup| GemmKernel::Coop { kernel, subgroup })),
        }
    }
    let mut builds = Vec::new();
    for kernel in KernelId::ALL {
        match kernel.gemm_layout() {
            Some(_) => builds.extend(gemms.iter().map(|&g| kernel.build(g))),
            None => builds.push(kernel.build(GemmKernel::Tiled)),
        }
    }
    let mut failures = Vec::new();
    let (mut compiled, mut glsl, mut ptx) = (0, 0, 0);
    for build in &builds {
        match headkl_ptx::check_build(build) {
            Ok(None) => {}
            Ok(Some(_)) => {
                ptx += 1;
                continue;
            }
            Err(e) => {
                failures.push(e);
                continue;
            }
        }
        let KernelSource::Wgsl(shader) = &build.source else {
            // SPIR-V present, with the catalogue's bindings, workgroup
            // and workgroup memory.
            match headkl_glsl::check_build(build) {
                Ok(_) => glsl += 1,
                Err(e) => failures.push(e),
            }
            continue;
        };
        let parsed = match parse(shader, &target) {
            Ok(p) => p,
            Err(e) => {
                failures.push(e.to_string());
                continue;
            }
        };
        let file = shader.file;
        for checked in [false, true] {
            match compile(&parsed, file, build.entry, &build.overrides, &target, checked) {
                Ok(c) => {
                    assert_eq!(c.words.first(), Some(&0x0723_0203), "SPIR-V magic");
                    let (caps, memory_model) = spirv_declarations(&c.words);
                    let coop = build.matrix_units;
                    assert_eq!(
                        caps.contains(&Capability::CooperativeMatrixKHR),
                        coop,
                        "{file}: {caps:?}"
                    );
                    // naga switches to the Vulkan memory model with
                    // cooperative matrices (the device must enable it).
                    assert_eq!(memory_model, if coop { 3 } else { 1 }, "{file}");
                    assert_eq!(
                        c.workgroup_size.iter().product::<u32>(),
                        build.invocations,
                        "{file}:{} {:?}",
                        build.entry,
                        build.overrides
                    );
                    compiled += 1;
                }
                Err(e) => failures.push(format!("{:?} checked={checked}: {e}", build.overrides)),
            }
        }
    }
    assert!(failures.is_empty(), "shader compile failures:\n{}", failures.join("\n"));
    // 4 fixed kernels (kl_rows, topk_rows, sum_parts, transpose), the 11
    // device-resident ones; per GEMM (logits, dx, dx filtered) the tiled
    // kernel and 19 matrix-unit tiles at 3 subgroup sizes; each checked and
    // unchecked.
    assert_eq!(compiled, 2 * (4 + 11 + 3 * (1 + 19 * 3)));
    // Every GLSL tile, all three GEMMs, and the filtered dx GEMM's GLSL
    // tile beside each PTX tile; the PTX tiles' logits and dx entry points.
    let ptx_tiles = headkl_core::toolkit::CoopGemm::candidates()
        .into_iter()
        .filter(|k| matches!(k, headkl_core::toolkit::CoopGemm::Wgmma(_)))
        .count();
    assert!(ptx_tiles >= 3, "{ptx_tiles} PTX tiles among the candidates");
    assert_eq!(glsl, 3 * headkl_core::toolkit::glsl_tile::GLSL_TILES.len() + ptx_tiles);
    assert_eq!(ptx, 2 * ptx_tiles);
}

/// Every term set of the KL rows (each a pipeline of its own, the
/// `KL_FLAGS` override) compiles, checked and unchecked: the conformance
/// suite runs only the sets its cases name.
#[test]
fn every_kl_rows_specialization_compiles_to_spirv() {
    use headkl_core::toolkit::params::row_flags as f;
    let target = ShaderTarget::everything();
    let build = KernelId::KlRows.build(GemmKernel::Tiled);
    let KernelSource::Wgsl(shader) = &build.source else {
        panic!("kl_rows is WGSL");
    };
    let parsed = parse(shader, &target).expect("kl_rows parses");
    let mut sets = vec![0];
    for bits in 0u32..32 {
        let (cap, hard, z, tau) = (bits & 1, (bits >> 1) & 1, (bits >> 2) & 1, (bits >> 3) & 3);
        for tail in 0..3u32 {
            let mut flags = f::GENERAL | (tail << f::TAIL_SHIFT);
            flags |= (cap * f::SOFTCAP) | (hard * f::HARD) | (z * f::Z_LOSS);
            if tau > 0 {
                // τ ≠ 1: not an integer, or 2 or 3.
                flags |= f::TAU | if tau == 1 { 0 } else { tau << f::TAU_POW_SHIFT };
            }
            sets.push(flags);
        }
    }
    sets.sort_unstable();
    sets.dedup();
    assert_eq!(sets.len(), 1 + 3 * 2 * 2 * 2 * 4);
    // The dense teacher's rows: each divergence, τ = 1, τ not an integer,
    // τ = 2.
    for divergence in 0..3u32 {
        for tau in [0, f::TAU, f::TAU | (2 << f::TAU_POW_SHIFT)] {
            sets.push(f::GENERAL | f::DENSE_TEACHER | (divergence << f::DIVERGENCE_SHIFT) | tau);
        }
    }
    for flags in sets {
        for checked in [false, true] {
            let overrides = vec![(headkl_core::toolkit::kernels::KL_FLAGS, flags)];
            let c = compile(&parsed, shader.file, build.entry, &overrides, &target, checked)
                .unwrap_or_else(|e| panic!("KL_FLAGS {flags:#x} checked={checked}: {e}"));
            assert_eq!(c.words.first(), Some(&0x0723_0203), "SPIR-V magic");
        }
    }
}

/// The GLSL tiles on the device the tests run on: where the GEMM has no
/// matrix units (lavapipe in CI) naming them is a typed error and the
/// ceiling report has nothing to run; where they are taken (the H200), the
/// kernel cases pass with them.
#[test]
fn glsl_tiles_run_or_are_refused_with_a_typed_error() {
    let Some(mut b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    let choice = GemmChoice::parse("logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk32.s2", crate::DEFAULT_GEMM).unwrap();
    let outcome = b.use_gemm(choice);
    let accepted = gemm_choice_outcome(&b, choice, outcome).unwrap();
    if accepted {
        assert_eq!(b.gemm_choice(), Some(choice));
        assert!(b.gemm_kernel().contains("glsl:bm128.bk64.s1"), "{}", b.gemm_kernel());
        assert_eq!(b.glsl_unavailable(), None);
    } else {
        assert_ne!(b.gemm_choice(), Some(choice));
        assert!(b.glsl_unavailable().is_some());
        assert!(b.ceiling_kernels().is_empty());
    }
    assert_clean(&b);
}

#[test]
fn validation_errors_are_collected() {
    let Some(b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    assert!(b.validation_layer().is_some(), "validation was asked for");
    assert_clean(&b);
    // A zero-sized buffer is invalid usage (VUID-VkBufferCreateInfo-size-00912).
    let info = ash::vk::BufferCreateInfo::default()
        .size(0)
        .usage(ash::vk::BufferUsageFlags::STORAGE_BUFFER);
    // SAFETY: deliberately invalid create info on a valid device, to see the
    // layer report it; a buffer the driver still returns is destroyed.
    unsafe {
        if let Ok(buffer) = b.device.raw.create_buffer(&info, None) {
            b.device.raw.destroy_buffer(buffer, None);
        }
    }
    let d = b.take_diagnostics();
    assert!(d.iter().any(|m| m.contains("00912")), "layer did not report it: {d:?}");
    assert!(b.take_diagnostics().is_empty(), "take clears");
}

#[test]
fn backend_and_buffers_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<VulkanBackend>();
    send_sync::<crate::VulkanBuffer>();
    let Some(b) = open(crate::command::STAGING_BYTES) else {
        return;
    };
    // Two threads sharing one backend: the stream's lock orders their work.
    std::thread::scope(|s| {
        for t in 0..2u8 {
            let b = &b;
            s.spawn(move || {
                let x = b.alloc(4096, "x").unwrap();
                for round in 0..20u8 {
                    let data = vec![t.wrapping_mul(31).wrapping_add(round); 4096];
                    b.upload(&x, 0, &data).unwrap();
                    let mut out = vec![0u8; 4096];
                    b.download(&x, 0, &mut out).unwrap();
                    assert_eq!(out, data);
                }
            });
        }
    });
    assert_clean(&b);
}
