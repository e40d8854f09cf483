// Shared by the resident_*.wgsl kernels: the catalogue prepends this file to
// each (headkl_core::toolkit::kernels, WGSL has no include). See shaders/README.md, "Device-resident kernels".
enable f16;

// <params: generated from crates/core/src/toolkit/params.rs (headkl_core::toolkit::kernels::Shader::source)>

// The status buffer's words and detail kinds, the codes the kernels compare
// parameters against, and MASS_TOLERANCE (headkl_core::resident::status::wgsl).
// <resident constants: generated from crates/core/src/resident/status.rs (headkl_core::toolkit::kernels::Shader::source)>

fn non_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) >= 0x7f800000u;
}

// Negative and not -0 (decided on the bits).
fn negative(x: f32) -> bool {
    let b = bitcast<u32>(x);
    return (b & 0x80000000u) != 0u && (b & 0x7fffffffu) != 0u;
}

// The linear index of invocation lid of workgroup wg in the folded grid
// (shaders/README.md, "Folded grids"; every parameter block has grid_x).
fn invocation_index(wg: vec3<u32>, lid: u32) -> u32 {
    return (wg.x + wg.y * params.grid_x) * WG + lid;
}

// The cell of a [rows][cols] grid (cols > 0) that an invocation owns, one
// invocation per cell: its flat index, row and column, and whether it is
// inside the grid (an invocation past it does nothing).
struct Cell {
    i: u32,
    row: u32,
    col: u32,
    inside: bool,
}

fn cell_of(wg: vec3<u32>, lid: u32, rows: u32, cols: u32) -> Cell {
    let i = invocation_index(wg, lid);
    return Cell(i, i / cols, i % cols, i < rows * cols);
}
