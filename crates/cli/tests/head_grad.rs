//! `headkl loss --head-grad FILE`: the head's gradient `[V][hs]` beside the
//! loss, on every backend that starts, against a plain f64 computation;
//! and the options it does not go with.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod common;

use std::fs;

use safetensors::SafeTensors;

use common::*;

/// `∂mean/∂W` of the default loss (forward KL against the renormalized
/// top-k, τ = 1, unit weights) in f64: `Σ_t (p_S,t − p̂_T,t)_j · x_t / ntok`.
fn head_grad_f64(f: &Fixture) -> Vec<f64> {
    let mut dw = vec![0f64; VOCAB * HS];
    for t in 0..NTOK {
        let x = &f.hidden[t * HS..(t + 1) * HS];
        let logits: Vec<f64> = (0..VOCAB)
            .map(|j| {
                let w = &f.head[j * HS..(j + 1) * HS];
                w.iter().zip(x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
            })
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|&z| (z - max).exp()).sum();
        let mut g: Vec<f64> = logits.iter().map(|&z| (z - max).exp() / sum).collect();
        let probs = &f.probs[t * K..(t + 1) * K];
        let mass: f64 = probs.iter().map(|&p| f64::from(p)).sum();
        for (&id, &p) in f.ids[t * K..(t + 1) * K].iter().zip(probs) {
            g[id as usize] -= f64::from(p) / mass;
        }
        for (j, &gj) in g.iter().enumerate() {
            for (o, &xv) in dw[j * HS..(j + 1) * HS].iter_mut().zip(x) {
                *o += gj * f64::from(xv) / NTOK as f64;
            }
        }
    }
    dw
}

/// The file holds F32 `grad` `[V][hs]`, within f16 rounding of the f64
/// gradient, and the loss file beside it is what a run without the flag
/// writes.
#[test]
fn loss_writes_the_head_gradient_on_every_backend() {
    let f = Fixture::new("head-grad");
    let want = head_grad_f64(&f);
    let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
    assert!(norm > 0.0);
    let plain = f.loss("teacher.safetensors", &[]);
    assert_eq!(plain.status.code(), Some(0), "{}", stderr(&plain));
    let plain_grad = tensor_f32(
        &SafeTensors::deserialize(&fs::read(f.path("out.safetensors")).unwrap()).unwrap(),
        "grad",
    );
    for backend in ["reference", "wgpu", "vulkan"] {
        let dw_path = f.s("dw.safetensors");
        let o = f.run_on(
            backend,
            "loss",
            "head.safetensors",
            "hidden.safetensors",
            &[
                "--teacher",
                f.s("teacher.safetensors"),
                "--out",
                f.s("out.safetensors"),
                "--head-grad",
                dw_path,
            ],
        );
        if !ran(backend, &o) {
            continue;
        }
        let bytes = fs::read(dw_path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("grad").unwrap().shape(), &[VOCAB, HS], "{backend}");
        let got = tensor_f32(&st, "grad");
        let err = got
            .iter()
            .zip(&want)
            .map(|(&g, &w)| (f64::from(g) - w).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(
            err <= 5e-3 * norm,
            "{backend}: ‖dW − dW_f64‖ = {err:.3e}, ‖dW_f64‖ = {norm:.3e}"
        );
        if backend == "reference" {
            let out = SafeTensors::deserialize(&fs::read(f.path("out.safetensors")).unwrap())
                .map(|st| tensor_f32(&st, "grad"))
                .unwrap();
            assert_eq!(out, plain_grad, "dx changed with --head-grad");
        }
        fs::remove_file(dw_path).unwrap();
    }
}

/// `--head-grad` naming `--out`'s file or an input, or beside `--shards`,
/// is exit 2 naming the option, and writes nothing.
#[test]
fn head_grad_refuses_what_it_cannot_do() {
    let f = Fixture::new("head-grad-bad");
    let same = f.loss("teacher.safetensors", &["--head-grad", f.s("out.safetensors")]);
    assert_input_error(&same, &["--head-grad", "--out"]);
    let input = f.loss("teacher.safetensors", &["--head-grad", f.s("hidden.safetensors")]);
    assert_input_error(&input, &["--head-grad", "also an input"]);
    let sharded = f.loss(
        "teacher.safetensors",
        &["--head-grad", f.s("dw.safetensors"), "--shards", "2"],
    );
    assert_input_error(&sharded, &["head-grad"]);
    assert!(!f.path("dw.safetensors").exists());
    assert!(!f.path("out.safetensors").exists());
}
