//! The peer benchmark runs (a tiny shape, on whatever device this machine
//! has) and both methods compute the same loss.

#[path = "../examples/bench_burn.rs"]
mod bench_burn;

mod common;

#[test]
fn bench_runs_both_methods_on_a_tiny_shape() {
    let Some(shared) = common::open() else {
        return;
    };
    let cfg = bench_burn::Config::from_args(
        ["--shape", "tiny", "--reps", "2", "--warmup", "1", "--dtype", "f32"]
            .map(String::from)
            .into_iter(),
    )
    .expect("flags");
    let rows = bench_burn::run_on(&shared, &cfg).expect("bench");
    assert_eq!(
        rows.iter().map(|r| r.method).collect::<Vec<_>>(),
        ["headkl-burn", "burn unfused"]
    );
    for r in &rows {
        assert_eq!(r.all_ms.len(), 2);
        assert!(r.ms > 0.0 && r.loss.is_finite() && r.loss > 0.0, "{r:?}");
    }
    let (a, b) = (rows[0].loss, rows[1].loss);
    assert!((a - b).abs() <= 1e-3 * b.abs(), "headkl-burn {a}, burn unfused {b}");
}

#[test]
fn shapes_parse() {
    use headkl_core::Shape;
    assert_eq!(bench_burn::parse_shape("A"), Ok(Shape::new(4096, 248_320, 5120, 64)));
    assert_eq!(bench_burn::parse_shape("tiny"), Ok(Shape::new(64, 512, 64, 8)));
    assert_eq!(bench_burn::parse_shape("8:100:16:4"), Ok(Shape::new(8, 100, 16, 4)));
    assert!(bench_burn::parse_shape("8:100:16").is_err());
    assert!(bench_burn::parse_shape("8:10:16:40").is_err());
}
