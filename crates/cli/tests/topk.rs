//! `headkl topk` against `headkl_reference::direct`.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use headkl_core::{HeadData, HeadWeights, Hidden};
use headkl_reference::direct::topk_f64;
use headkl_reference::Tolerance;

use common::*;

#[test]
fn topk_matches_direct() {
    let f = Fixture::new("topk");
    let o = f.topk_k("top.safetensors", 7, &["--temperature", "0.8"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (ids, probs) = read_topk(&f.path("top.safetensors"), 7);
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
    let want = topk_f64(&head, &hidden, 7, 0.8);
    Tolerance::default().check_topk(&ids, &probs, &want).unwrap();
}

/// `topk --logit-scale 2 --temperature 1.6` is the top-k of 2·z/1.6, the
/// reference's at τ = 0.8, and the file records the scale; a scale that is
/// not positive is exit 2 naming `--logit-scale`.
#[test]
fn topk_logit_scale_matches_direct() {
    let f = Fixture::new("topk-scale");
    let out = f.path("top.safetensors");
    let run = |scale: &str| f.topk_k("top.safetensors", 7, &["--temperature", "1.6", "--logit-scale", scale]);
    let o = run("2");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (ids, probs) = read_topk(&out, 7);
    let head = HeadWeights::new(HeadData::F32(&f.head), VOCAB, HS).unwrap();
    let hidden = Hidden::f32(&f.hidden, NTOK, HS).unwrap();
    Tolerance::default()
        .check_topk(&ids, &probs, &topk_f64(&head, &hidden, 7, 0.8))
        .unwrap();
    assert_eq!(metadata(&out).get("headkl.logit_scale").map(String::as_str), Some("2"));
    assert_input_error(&run("0"), &["--logit-scale", "logit_scale = 0"]);
}
