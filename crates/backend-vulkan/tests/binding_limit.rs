//! A head larger than the device's largest storage binding (lavapipe's is
//! 128 MiB) is cut into several slices by the binding limit itself, not by
//! the test knob: `topk` through the driver against the f64 reference, with
//! every GEMM binding a plane near the limit. (`head_kl` over several slices,
//! dx summed across them, is in the conformance suite with the slice knob;
//! lavapipe needs several seconds per pass over a 128 MiB head, so this test
//! makes one.)

use headkl_conformance::generator::{Case, CaseKind, CaseParams, TeacherShape};
use headkl_conformance::{check_case, harness_env, open_or_skip};
use headkl_core::{round_up, slice_vocab, Backend, ALIGN};
use headkl_vulkan::{VulkanBackend, VulkanOptions};

fn case(kind: CaseKind, vocab: usize, hs: usize) -> Case {
    Case::from_params(&CaseParams {
        kind,
        profile: "binding_limit",
        vocab,
        hs,
        ntok: 5,
        k: 64,
        data_seed: 0x5eed,
        teacher: TeacherShape::Random,
        large: false,
        ties: false,
        residue: false,
        masked: true,
        temperature: 1.0,
        hidden_as_f16: false,
        max_rows_per_slice: None,
        max_rows_per_chunk: None,
    })
}

/// The backend with the validation layer on, or `None` where it cannot
/// start (said, or a failure where `HEADKL_REQUIRE` names it).
fn open() -> Option<VulkanBackend> {
    open_or_skip("vulkan", || {
        VulkanBackend::open_with(&VulkanOptions {
            validation: true,
            ..VulkanOptions::from_env(&harness_env()).expect("a HEADKL_* setting does not parse")
        })
    })
}

#[test]
fn topk_past_the_binding_limit_runs_in_several_slices() {
    let Some(b) = open() else {
        return;
    };
    let info = b.info().clone();
    let binding = info.max_binding_bytes.min(info.max_buffer_bytes);
    // Past the binding by about 3%, and a few GEMM tiles of work on a CPU
    // device; past 1 GiB of host memory on a big-binding GPU, so skip there.
    let hs = 1030;
    let vocab = (binding as f64 * 1.03 / (round_up(hs, ALIGN) * 2) as f64) as usize;
    if vocab * hs * 4 > 1 << 30 {
        eprintln!(
            "SKIPPED: binding {binding} bytes would need a {} MiB head",
            (vocab * hs * 4) >> 20
        );
        return;
    }
    let slices = slice_vocab(vocab, round_up(hs, ALIGN), binding, None).unwrap();
    assert!(slices.len() >= 2, "V = {vocab} gave {} slice(s)", slices.len());
    let c = case(CaseKind::Topk, vocab, hs);
    let errors = check_case(&b, &c).unwrap_or_else(|e| panic!("{}: {e}", c.describe()));
    eprintln!(
        "topk V={vocab} hs={hs} k={} in {} slices: probability error {:?}",
        c.k,
        slices.len(),
        errors.prob
    );
    assert!(errors.prob.is_some(), "probabilities were compared");
    let d = b.take_diagnostics();
    assert!(d.is_empty(), "validation messages:\n{}", d.join("\n"));
}

/// The resident head gradient of a head whose f32 gradient is past the
/// largest binding (lavapipe: 128 MiB) is written into the caller's
/// buffer through windows of it, against the f64 reference and the host
/// path; a GPU's binding of GiBs would need GiBs of host memory, so there
/// it says so and skips.
#[test]
fn resident_head_grad_past_the_binding_limit_goes_through_windows() {
    let Some(b) = open() else {
        return;
    };
    headkl_conformance::resident::test_head_grad_past_the_binding(&b);
    let d = b.take_diagnostics();
    assert!(d.is_empty(), "validation messages:\n{}", d.join("\n"));
}
