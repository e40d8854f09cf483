//! headkl's convergence test: the `distill_step` example, small, must learn
//! (its loss falls by at least half). A gradient of the wrong sign or scale
//! would not.

#[path = "../examples/distill_step.rs"]
#[allow(dead_code, reason = "the test calls the example's `run`, never its `main`")]
mod distill_step;

use headkl_conformance::open_or_skip;

#[test]
fn distill_step_learns() {
    let cfg = distill_step::Config {
        steps: 30,
        ntok: 64,
        vocab: 512,
        hs: 64,
        features: 16,
        k: 16,
        lr: 2.0,
        seed: 1,
    };
    // Whether this machine has a wgpu adapter at all (SKIP, or a failure
    // under HEADKL_REQUIRE); past that, any error fails the test.
    if open_or_skip("wgpu", || headkl_wgpu::WgpuBackend::open(None)).is_none() {
        return;
    }
    let losses = distill_step::run(&cfg).expect("distill_step");
    assert_eq!(losses.len(), cfg.steps);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let (first, last) = (losses[0], losses[cfg.steps - 1]);
    assert!(last <= 0.5 * first, "loss fell from {first} to {last} only: {losses:?}");
}

#[test]
fn flags_parse() {
    let cfg =
        distill_step::Config::from_args(["--steps", "7", "--lr", "0.25"].map(String::from).into_iter()).expect("flags");
    assert_eq!((cfg.steps, cfg.lr), (7, 0.25));
    assert!(distill_step::Config::from_args(["--steps", "0"].map(String::from).into_iter()).is_err());
    assert!(distill_step::Config::from_args(["--bogus", "1"].map(String::from).into_iter()).is_err());
}
