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

/// `--head-grad-dtype bf16` and `f16` write the f32 run's gradient with
/// each value rounded once to nearest even, tagged BF16 or F16; the loss
/// file is the f32 run's. Without `--head-grad` the option is exit 2
/// naming what it needs.
#[test]
fn head_grad_is_written_in_the_type_asked() {
    let f = Fixture::new("head-grad-dtype");
    let dw = |extra: &[&str]| {
        let mut args = vec!["--head-grad", f.s("dw.safetensors")];
        args.extend(extra);
        let o = f.loss("teacher.safetensors", &args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let st = fs::read(f.path("dw.safetensors")).unwrap();
        let out = fs::read(f.path("out.safetensors")).unwrap();
        (st, out)
    };
    let (f32_file, f32_out) = dw(&[]);
    let f32_st = SafeTensors::deserialize(&f32_file).unwrap();
    assert_eq!(f32_st.tensor("grad").unwrap().dtype(), safetensors::Dtype::F32);
    let want = tensor_f32(&f32_st, "grad");
    assert!(want.iter().any(|&v| v != 0.0));
    type Rounding = (&'static str, safetensors::Dtype, fn(f32) -> u16);
    let round: [Rounding; 2] = [
        ("bf16", safetensors::Dtype::BF16, |v| half::bf16::from_f32(v).to_bits()),
        ("f16", safetensors::Dtype::F16, |v| half::f16::from_f32(v).to_bits()),
    ];
    for (name, dtype, to_bits) in round {
        let (file, out) = dw(&["--head-grad-dtype", name]);
        let st = SafeTensors::deserialize(&file).unwrap();
        let grad = st.tensor("grad").unwrap();
        assert_eq!((grad.dtype(), grad.shape()), (dtype, &[VOCAB, HS][..]), "{name}");
        let got: Vec<u16> = grad
            .data()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let rounded: Vec<u16> = want.iter().map(|&v| to_bits(v)).collect();
        assert_eq!(got, rounded, "{name}: not the f32 gradient rounded once");
        let (out, f32_out) = (
            SafeTensors::deserialize(&out).unwrap(),
            SafeTensors::deserialize(&f32_out).unwrap(),
        );
        for tensor in ["loss", "grad"] {
            assert_eq!(
                tensor_f32(&out, tensor),
                tensor_f32(&f32_out, tensor),
                "{name}: {tensor} changed"
            );
        }
    }
    fs::remove_file(f.path("dw.safetensors")).unwrap();
    let alone = f.loss("teacher.safetensors", &["--head-grad-dtype", "bf16"]);
    assert_eq!(alone.status.code(), Some(2), "{}", stderr(&alone));
    assert!(
        stderr(&alone).contains("--head-grad <DW.safetensors>"),
        "{}",
        stderr(&alone)
    );
}
