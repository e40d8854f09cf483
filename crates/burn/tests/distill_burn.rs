//! The `distill_burn` example, small, must learn through headkl's loss (its
//! loss falls by at least half), and its first steps must agree with the
//! same student trained through the loss written the burn way.

#[path = "../examples/distill_burn.rs"]
#[allow(dead_code, reason = "the test calls the example's `run`, never its `main`")]
mod distill_burn;

mod common;

#[test]
fn distill_burn_learns_and_its_first_steps_agree_with_burns_loss() {
    let Some(shared) = common::open() else {
        return;
    };
    let cfg = distill_burn::Config::default();
    let losses = distill_burn::run_on(&shared, &cfg).expect("distill_burn");
    assert_eq!(losses.len(), cfg.steps);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let (first, last) = (losses[0], losses[cfg.steps - 1]);
    assert!(last <= 0.5 * first, "loss fell from {first} to {last} only: {losses:?}");

    // The same run, the loss written the burn way: the first steps agree.
    let unfused_cfg = distill_burn::Config {
        steps: 3,
        unfused: true,
        ..cfg.clone()
    };
    let theirs = distill_burn::run_on(&shared, &unfused_cfg).expect("distill_burn --unfused");
    for (step, (a, b)) in losses.iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() <= 1e-3 * b.abs(), "step {step}: headkl {a}, burn {b}");
    }
}

#[test]
fn flags_parse() {
    let cfg = distill_burn::Config::from_args(
        ["--steps", "7", "--lr", "0.25", "--unfused"]
            .map(String::from)
            .into_iter(),
    )
    .expect("flags");
    assert_eq!((cfg.steps, cfg.lr, cfg.unfused), (7, 0.25, true));
    assert!(distill_burn::Config::from_args(["--steps", "0"].map(String::from).into_iter()).is_err());
    assert!(distill_burn::Config::from_args(["--bogus", "1"].map(String::from).into_iter()).is_err());
}
