//! Rewrites `shaders/cuda/generated.cuh` from headkl-core (then run
//! `scripts/ptx.sh` to recompile the kernels).

fn main() -> std::io::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = root.join(headkl_ptx::header::PATH);
    std::fs::write(&path, headkl_ptx::header::text())?;
    println!("wrote {}", path.display());
    Ok(())
}
