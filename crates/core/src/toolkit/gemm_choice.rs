//! Which matrix-unit GEMM kernel runs for each head layout, the names users
//! and the tune cache give them, and how a choice is resolved and fitted to
//! a device. (The cache itself is `crate::toolkit::tune_cache`; the kernels' shaders
//! and tiles, `crate::toolkit::kernels`.)
//!
//! A kernel is named `direct` (`gemm_coop_direct.wgsl`),
//! `staged:bk<16|32|64>:r<2|4>:s<1|2>[:pf]` (`gemm_coop.wgsl` with its `BK`,
//! `SG_ROWS`, `STAGES` and `PREFETCH` overrides) or `glsl:<tile>`
//! (`gemm_khr.comp` compiled with a tile of [`GLSL_TILES`], e.g.
//! `glsl:bm128.bk64.s1`) or `wgmma:<tile>` (the PTX tiles of
//! `gemm_wgmma.cu`, [`WGMMA_TILES`], e.g. `wgmma:bm128.s2`). A choice names
//! one kernel for both layouts or one each:
//! `logits=glsl:bm128.bk64.s1,dx=staged:bk32:r4:s1:pf`.

use std::fmt;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::toolkit::backend::HeadLayout;
use crate::toolkit::glsl_tile::{GlslTile, GLSL_BN, GLSL_SUBGROUP, GLSL_TILES};
use crate::toolkit::tune_cache::TuneCache;
use crate::toolkit::wgmma_tile::{WgmmaTile, WGMMA_TILES};

/// The environment variable that picks the GEMM kernels.
pub const GEMM_ENV: &str = "HEADKL_GEMM";

/// Tile parameters of the staged matrix-unit GEMM (`gemm_coop.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StagedTile {
    /// K staged per step (`BK`): 16, 32 or 64.
    pub bk: u32,
    /// Rows of subgroups (`SG_ROWS`): 2 or 4. The workgroup is `rows × 2`
    /// subgroups, each owning 64 × 64 of a `(64·rows) × 128` C tile.
    pub rows: u32,
    /// Workgroup-memory stages (`STAGES`): 1 loads a step's tiles and then
    /// multiplies them; 2 loads step s+1 into registers while step s
    /// multiplies, into a second buffer (one barrier per step).
    pub stages: u32,
    /// With one stage, load step s+1 into registers before step s
    /// multiplies, and store it between two barriers (`PREFETCH`; two
    /// stages always do).
    pub prefetch: bool,
}

impl StagedTile {
    /// C rows per workgroup.
    pub const fn tile_rows(self) -> u32 {
        64 * self.rows
    }

    /// Workgroup memory in bytes: per stage, A `[64·rows][bk + 8]` and
    /// B `[128][bk + 8]` f16 (the B of the other layout, `[bk][128 + 8]`,
    /// is never larger).
    pub const fn shared_bytes(self) -> u32 {
        self.stages * (64 * self.rows + 128) * (self.bk + 8) * 2
    }

    fn check(self, value: &str) -> Result<Self> {
        let bad = |reason: &str| Err(invalid(value, reason));
        if !matches!(self.bk, 16 | 32 | 64) {
            return bad("bk must be 16, 32 or 64");
        }
        if !matches!(self.rows, 2 | 4) {
            return bad("r (rows of subgroups) must be 2 or 4");
        }
        if !matches!(self.stages, 1 | 2) {
            return bad("s (stages) must be 1 or 2");
        }
        if self.stages == 2 && self.prefetch {
            return bad("pf (prefetch) goes with s1: two stages always prefetch");
        }
        Ok(self)
    }
}

/// One matrix-unit GEMM kernel with its tile parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoopGemm {
    /// `gemm_coop.wgsl`: tiles staged through workgroup memory.
    Staged(StagedTile),
    /// `gemm_coop_direct.wgsl`: one subgroup per 64 × 64, fragments straight
    /// from storage, no workgroup memory.
    Direct,
    /// `gemm_khr.comp` (GLSL, SPIR-V built by `headkl-glsl`) with this tile:
    /// 16-byte workgroup stores the WGSL kernels cannot express. Subgroups
    /// of exactly 32, and a backend that can load SPIR-V
    /// ([`KernelLimits::spirv`]).
    Glsl(GlslTile),
    /// `gemm_wgmma.cu` (PTX for NVIDIA Hopper's `wgmma`, launched through
    /// `VK_NVX_binary_import`) with this tile: the Vulkan backend on a
    /// device with that extension and buffer device addresses
    /// ([`KernelLimits::ptx`]).
    Wgmma(WgmmaTile),
}

impl CoopGemm {
    /// C tile per workgroup `(rows, columns)`.
    pub const fn tile(self) -> (u32, u32) {
        match self {
            Self::Staged(t) => (t.tile_rows(), 128),
            Self::Direct => (64, 64),
            Self::Glsl(t) => (t.bm, GLSL_BN),
            Self::Wgmma(t) => (t.bm, t.bn()),
        }
    }

    /// Invocations per workgroup at subgroup size `subgroup`.
    pub const fn invocations(self, subgroup: u32) -> u32 {
        match self {
            Self::Staged(t) => 2 * t.rows * subgroup,
            Self::Direct => subgroup,
            // Written for subgroups of 32 (`misfit` refuses others).
            Self::Glsl(t) => t.invocations(),
            Self::Wgmma(t) => t.invocations(),
        }
    }

    /// Workgroup memory in bytes.
    pub const fn shared_bytes(self) -> u32 {
        match self {
            Self::Staged(t) => t.shared_bytes(),
            Self::Direct => 0,
            Self::Glsl(t) => t.shared_bytes(),
            Self::Wgmma(t) => t.shared_bytes(),
        }
    }

    /// The shader's `override` values at subgroup size `subgroup`
    /// (shaders/README.md), as both backends pass them.
    pub fn overrides(self, subgroup: u32) -> Vec<(&'static str, u32)> {
        match self {
            Self::Staged(t) => vec![
                ("SG_SIZE", subgroup),
                ("BK", t.bk),
                ("SG_ROWS", t.rows),
                ("STAGES", t.stages),
                ("PREFETCH", u32::from(t.prefetch)),
            ],
            Self::Direct => vec![("SG_SIZE", subgroup)],
            // Defines and templates, compiled in at build time.
            Self::Glsl(_) | Self::Wgmma(_) => Vec::new(),
        }
    }

    /// Whether it uses subgroup builtins (`subgroup_id`).
    pub const fn needs_subgroup_id(self) -> bool {
        matches!(self, Self::Staged(_) | Self::Glsl(_))
    }

    /// Every kernel `headkl tune` tries, cheapest to build first: the WGSL
    /// kernels, then the GLSL tiles and the PTX copy tiles (which a device
    /// that cannot run them refuses at open: [`CoopGemm::misfit`]); not the
    /// PTX bulk tiles (below).
    pub fn candidates() -> Vec<CoopGemm> {
        let mut all = vec![Self::Direct];
        for (stages, prefetch) in [(1, false), (1, true), (2, false)] {
            for bk in [16, 32, 64] {
                for rows in [2, 4] {
                    all.push(Self::Staged(tile(bk, rows, stages, prefetch)));
                }
            }
        }
        all.extend(GLSL_TILES.map(Self::Glsl));
        // The bulk PTX tiles pack the head every GEMM, a call's every chunk
        // of rows: faster alone, slower in head_kl at shape A (docs/
        // PERFORMANCE.md, row 54), and `tune` times neither a call's chunks
        // of dx nor its split-K parts. `HEADKL_GEMM` can name them.
        all.extend(
            WGMMA_TILES
                .into_iter()
                .filter(|t| t.feed == crate::toolkit::WgmmaFeed::Copies)
                .map(Self::Wgmma),
        );
        all
    }

    /// Parses `direct`, `staged:bk32:r2:s2` (fields in any order, `pf`
    /// for prefetch with one stage; missing ones take the default tile's) or
    /// `glsl:bm128.bk64.s1` (a tile of [`GLSL_TILES`]) or `wgmma:bm128.s2`
    /// (a tile of [`WGMMA_TILES`]).
    pub fn parse(value: &str) -> Result<Self> {
        let text = value.trim();
        if text.eq_ignore_ascii_case("direct") {
            return Ok(Self::Direct);
        }
        if let Some(name) = text.strip_prefix("glsl:") {
            return named_tile(value, name, "GLSL", &GLSL_TILES, GlslTile::from_name).map(Self::Glsl);
        }
        if let Some(name) = text.strip_prefix("wgmma:") {
            return named_tile(value, name, "PTX", &WGMMA_TILES, WgmmaTile::from_name).map(Self::Wgmma);
        }
        let mut parts = text.split(':');
        if !parts.next().is_some_and(|p| p.eq_ignore_ascii_case("staged")) {
            return Err(invalid(
                value,
                "expected `direct`, `staged:bk<16|32|64>:r<2|4>:s<1|2>[:pf]`, `glsl:<tile>` or `wgmma:<tile>`",
            ));
        }
        let mut tile = DEFAULT_STAGED;
        for part in parts {
            if part == "pf" {
                tile.prefetch = true;
                continue;
            }
            let (field, digits) = part.split_at(part.find(|c: char| c.is_ascii_digit()).unwrap_or(part.len()));
            let Ok(n) = digits.parse::<u32>() else {
                return Err(invalid(
                    value,
                    &format!("`{part}` is not a field and a number (bk32, r2, s2)"),
                ));
            };
            match field {
                "bk" => tile.bk = n,
                "r" => tile.rows = n,
                "s" => tile.stages = n,
                _ => return Err(invalid(value, &format!("unknown field `{field}` (bk, r, s)"))),
            }
        }
        Ok(Self::Staged(tile.check(value)?))
    }
}

impl fmt::Display for CoopGemm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Staged(t) => {
                write!(f, "staged:bk{}:r{}:s{}", t.bk, t.rows, t.stages)?;
                if t.prefetch {
                    f.write_str(":pf")?;
                }
                Ok(())
            }
            Self::Direct => f.write_str("direct"),
            Self::Glsl(t) => write!(f, "glsl:{t}"),
            Self::Wgmma(t) => write!(f, "wgmma:{t}"),
        }
    }
}

const fn tile(bk: u32, rows: u32, stages: u32, prefetch: bool) -> StagedTile {
    StagedTile {
        bk,
        rows,
        stages,
        prefetch,
    }
}

/// What a name's missing fields take: K 32, 2 rows, two stages.
const DEFAULT_STAGED: StagedTile = tile(32, 2, 2, false);
/// The smallest tile: 12 KiB of workgroup memory, 4 subgroups.
const PORTABLE_TILE: StagedTile = tile(16, 2, 1, false);

/// The matrix-unit GEMM kernel for each head layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmChoice {
    /// For the logits, `x · Wᵀ` ([`HeadLayout::Logits`]).
    pub logits: CoopGemm,
    /// For the input gradient, `g · W` ([`HeadLayout::Dx`]).
    pub dx: CoopGemm,
}

impl GemmChoice {
    /// The default where the device runs the GLSL tiles (subgroups of 32,
    /// SPIR-V loaded as is): `glsl:bm128.bk64.s1` for both GEMMs, the
    /// fastest head_kl on the H200 (docs/PERFORMANCE.md rows 24–25; a tune
    /// cache entry still wins).
    pub const GLSL_DEFAULT: GemmChoice = GemmChoice {
        logits: CoopGemm::Glsl(crate::toolkit::glsl_tile::GLSL_BM128_BK64_S1),
        dx: CoopGemm::Glsl(crate::toolkit::glsl_tile::GLSL_BM128_BK64_S1),
    };

    /// The default where the device launches the PTX tiles (NVIDIA Hopper
    /// through `VK_NVX_binary_import`): the one-stage K-64 tile for the
    /// logits and the three-stage K-32 one for dx, the fastest of
    /// [`WGMMA_TILES`] for each on the H200 (docs/PERFORMANCE.md; a tune
    /// cache entry still wins).
    pub const WGMMA_DEFAULT: GemmChoice = GemmChoice {
        logits: CoopGemm::Wgmma(crate::toolkit::wgmma_tile::WGMMA_BM64_BK64_S1),
        dx: CoopGemm::Wgmma(crate::toolkit::wgmma_tile::WGMMA_BM64_BK32_S3),
    };

    /// The fallback where the default does not fit: the smallest staged
    /// tile (12 KiB of workgroup memory, 4 subgroups).
    pub const PORTABLE: GemmChoice = GemmChoice {
        logits: CoopGemm::Staged(PORTABLE_TILE),
        dx: CoopGemm::Staged(PORTABLE_TILE),
    };

    /// The kernel for `layout`.
    pub const fn for_layout(self, layout: HeadLayout) -> CoopGemm {
        match layout {
            HeadLayout::Logits => self.logits,
            HeadLayout::Dx => self.dx,
        }
    }

    /// Both kernels, deduplicated.
    pub fn kernels(self) -> Vec<CoopGemm> {
        if self.logits == self.dx {
            vec![self.logits]
        } else {
            vec![self.logits, self.dx]
        }
    }

    /// Why a kernel of `self` cannot run within `limits`, or `None` when
    /// both can ([`CoopGemm::misfit`]).
    pub fn misfit(self, limits: &KernelLimits) -> Option<String> {
        self.kernels().into_iter().find_map(|k| k.misfit(limits))
    }

    /// The default on a device whose matrix-unit GEMM has `limits`:
    /// [`Self::WGMMA_DEFAULT`] where the PTX tiles run, else
    /// [`Self::GLSL_DEFAULT`] where its tiles fit, else the backend's
    /// `wgsl_default`. A `HEADKL_GEMM` that names one GEMM keeps this for
    /// the other, so naming the dx kernel does not move the logits GEMM
    /// off the default tile.
    pub fn default_for(wgsl_default: GemmChoice, limits: Option<&KernelLimits>) -> GemmChoice {
        limits.and_then(Self::preferred).unwrap_or(wgsl_default)
    }

    /// The first of [`Self::WGMMA_DEFAULT`] and [`Self::GLSL_DEFAULT`] that
    /// runs within `limits`.
    pub fn preferred(limits: &KernelLimits) -> Option<GemmChoice> {
        [Self::WGMMA_DEFAULT, Self::GLSL_DEFAULT]
            .into_iter()
            .find(|c| c.misfit(limits).is_none())
    }

    /// Whether a kernel of it is a PTX tile.
    pub fn uses_ptx(self) -> bool {
        self.kernels().iter().any(|k| matches!(k, CoopGemm::Wgmma(_)))
    }

    /// For a backend's `use_gemm`, which switches its GEMM after opening:
    /// `Ok` where `self` runs on `device`, whose matrix-unit GEMM has
    /// `limits` (`None`: the GEMM runs tiled there), else an
    /// [`Error::InvalidSetting`] naming `HEADKL_GEMM`, `self` and why.
    pub fn check_use(self, device: &str, limits: Option<&KernelLimits>) -> Result<()> {
        let why = match limits {
            None => Some(format!(
                "{device} runs the tiled GEMM (no usable matrix units, or HEADKL_NO_COOPMAT)"
            )),
            Some(limits) => self.misfit(limits),
        };
        match why {
            None => Ok(()),
            Some(reason) => Err(Error::InvalidSetting {
                name: GEMM_ENV,
                value: self.to_string(),
                reason,
            }),
        }
    }

    /// Parses `KERNEL` (both layouts) or `logits=KERNEL,dx=KERNEL` (either
    /// part may be left out: it keeps `base`'s, the backend's default).
    pub fn parse(value: &str, base: GemmChoice) -> Result<Self> {
        Ok(GemmSetting::parse(value)?.over(base))
    }
}

/// A GEMM choice as `HEADKL_GEMM` names it, parsed once: the kernel for
/// each layout it names; a layout it leaves out keeps the backend's
/// default ([`GemmSetting::over`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmSetting {
    /// The logits GEMM's kernel, if named.
    pub logits: Option<CoopGemm>,
    /// The dx GEMM's kernel, if named.
    pub dx: Option<CoopGemm>,
}

impl GemmSetting {
    /// Parses `KERNEL` (both layouts) or `logits=KERNEL,dx=KERNEL`.
    pub fn parse(value: &str) -> Result<Self> {
        let text = value.trim();
        if !text.contains('=') {
            let kernel = Some(CoopGemm::parse(text)?);
            return Ok(Self {
                logits: kernel,
                dx: kernel,
            });
        }
        let mut setting = Self { logits: None, dx: None };
        for part in text.split(',') {
            let Some((layout, kernel)) = part.split_once('=') else {
                return Err(invalid(
                    value,
                    &format!("`{part}` is not `logits=KERNEL` or `dx=KERNEL`"),
                ));
            };
            let kernel = Some(CoopGemm::parse(kernel)?);
            match layout.trim() {
                "logits" => setting.logits = kernel,
                "dx" => setting.dx = kernel,
                other => return Err(invalid(value, &format!("unknown layout `{other}` (logits, dx)"))),
            }
        }
        Ok(setting)
    }

    /// The choice on top of `base`: each layout it names, else `base`'s.
    pub fn over(self, base: GemmChoice) -> GemmChoice {
        GemmChoice {
            logits: self.logits.unwrap_or(base.logits),
            dx: self.dx.unwrap_or(base.dx),
        }
    }
}

impl fmt::Display for GemmSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = [("logits", self.logits), ("dx", self.dx)]
            .iter()
            .filter_map(|(layout, k)| k.map(|k| format!("{layout}={k}")))
            .collect();
        f.write_str(&parts.join(","))
    }
}

impl fmt::Display for GemmChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "logits={},dx={}", self.logits, self.dx)
    }
}

/// The tile of `tiles` named `name` (found by `find`), or an error naming
/// `value` and listing the `kind` tiles there are.
fn named_tile<T: fmt::Display>(
    value: &str,
    name: &str,
    kind: &str,
    tiles: &[T],
    find: impl FnOnce(&str) -> Option<T>,
) -> Result<T> {
    find(name).ok_or_else(|| {
        let known: Vec<String> = tiles.iter().map(|t| t.to_string()).collect();
        invalid(
            value,
            &format!("`{name}` is not a {kind} tile (one of {})", known.join(", ")),
        )
    })
}

fn invalid(value: &str, reason: &str) -> Error {
    Error::InvalidSetting {
        name: GEMM_ENV,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// What a device allows a GEMM workgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLimits {
    /// Workgroup memory in bytes.
    pub shared_bytes: u32,
    /// Invocations per workgroup (the smaller of the total and x limits).
    pub invocations: u32,
    /// The subgroup size the kernels run with.
    pub subgroup_size: u32,
    /// Whether compute shaders have subgroup builtins (`subgroup_id`).
    pub subgroup_builtins: bool,
    /// Whether the backend can load the GLSL kernels' SPIR-V (SPIR-V 1.6:
    /// a Vulkan 1.3 device; on wgpu a Vulkan adapter with
    /// `PASSTHROUGH_SHADERS`), with their KHR cooperative matrices.
    pub spirv: bool,
    /// Whether the backend can launch the PTX tiles: the Vulkan backend on
    /// a device with `VK_NVX_binary_import` and buffer device addresses
    /// (the PTX itself is for sm_90a: the driver refuses it elsewhere, and
    /// the tile's first launch says so).
    pub ptx: bool,
}

impl KernelLimits {
    /// The H200's limits through Vulkan without the PTX tiles: 48 KiB of
    /// workgroup memory, subgroups of 32, SPIR-V passthrough (the tests'
    /// device).
    #[cfg(test)]
    pub(crate) const H200_SPIRV: KernelLimits = KernelLimits {
        shared_bytes: 48 << 10,
        invocations: 1024,
        subgroup_size: 32,
        subgroup_builtins: true,
        spirv: true,
        ptx: false,
    };
}

impl CoopGemm {
    /// Why this kernel cannot run within `limits`, or `None` when it can.
    pub fn misfit(self, limits: &KernelLimits) -> Option<String> {
        if let Self::Wgmma(_) = self {
            if !limits.ptx {
                return Some(format!(
                    "{self} needs the Vulkan backend on a device with VK_NVX_binary_import and buffer device addresses (NVIDIA's driver)"
                ));
            }
        }
        if let Self::Glsl(_) = self {
            if !limits.spirv {
                return Some(format!(
                    "{self} needs SPIR-V 1.6 loaded as is (Vulkan 1.3 on the Vulkan backend, a Vulkan adapter with PASSTHROUGH_SHADERS on wgpu)"
                ));
            }
            if limits.subgroup_size != GLSL_SUBGROUP {
                return Some(format!(
                    "{self} needs subgroups of {GLSL_SUBGROUP}, the device runs {}",
                    limits.subgroup_size
                ));
            }
        }
        if self.needs_subgroup_id() && !limits.subgroup_builtins {
            return Some(format!("{self} needs subgroup builtins"));
        }
        if limits.shared_bytes < self.shared_bytes() {
            return Some(format!(
                "{self} needs {} bytes of workgroup memory, the device has {}",
                self.shared_bytes(),
                limits.shared_bytes
            ));
        }
        let invocations = self.invocations(limits.subgroup_size);
        if limits.invocations < invocations {
            return Some(format!(
                "{self} needs workgroups of {invocations} invocations, the device allows {}",
                limits.invocations
            ));
        }
        None
    }
}

/// `choice` where each of its kernels fits `limits`. A default choice
/// becomes [`GemmChoice::preferred`] (the PTX tiles, else the GLSL ones)
/// where that fits. Where a kernel does not fit, an explicit choice
/// (options, `HEADKL_GEMM`) is an [`Error::InvalidSetting`]; any other
/// falls back to [`GemmChoice::preferred`], the backend's (WGSL) `default`,
/// [`GemmChoice::PORTABLE`], then the direct kernel, which needs no
/// workgroup memory.
pub fn fit_choice(
    default: GemmChoice,
    choice: GemmChoice,
    source: ChoiceSource,
    limits: &KernelLimits,
) -> Result<(GemmChoice, ChoiceSource)> {
    let misfit = |c: GemmChoice| c.misfit(limits);
    let preferred = GemmChoice::preferred(limits);
    match (misfit(choice), preferred) {
        (None, Some(best)) if source == ChoiceSource::Default => Ok((best, source)),
        (None, _) => Ok((choice, source)),
        (Some(why), _) if source.is_explicit() => Err(Error::InvalidSetting {
            name: GEMM_ENV,
            value: choice.to_string(),
            reason: format!("{why} (from {source})"),
        }),
        (Some(_), Some(best)) => Ok((best, ChoiceSource::Default)),
        (Some(_), None) if misfit(default).is_none() => Ok((default, ChoiceSource::Default)),
        (Some(_), None) if misfit(GemmChoice::PORTABLE).is_none() => Ok((GemmChoice::PORTABLE, ChoiceSource::Default)),
        (Some(_), None) => Ok((
            GemmChoice {
                logits: CoopGemm::Direct,
                dx: CoopGemm::Direct,
            },
            ChoiceSource::Default,
        )),
    }
}

/// Where a backend's [`GemmChoice`] came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChoiceSource {
    /// The caller's open options.
    Options,
    /// `HEADKL_GEMM`.
    Environment,
    /// The tune cache at this path.
    Cache(PathBuf),
    /// The backend's default.
    Default,
}

impl ChoiceSource {
    /// Whether the user named it (an error if it cannot run, rather than a
    /// quiet fallback).
    pub fn is_explicit(&self) -> bool {
        matches!(self, Self::Options | Self::Environment)
    }
}

impl fmt::Display for ChoiceSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Options => f.write_str("open options"),
            Self::Environment => write!(f, "{GEMM_ENV}"),
            Self::Cache(p) => write!(f, "tune cache {}", p.display()),
            Self::Default => f.write_str("default"),
        }
    }
}

/// The choice for a device: `explicit` (the open options) if given, else
/// `HEADKL_GEMM` as [`crate::toolkit::settings::GemmSources`] holds it (over `default`),
/// else the tune cache's entry for `(backend, device, driver)`, else the
/// backend's `default`.
pub fn resolve_choice(
    explicit: Option<GemmChoice>,
    default: GemmChoice,
    sources: &crate::toolkit::settings::GemmSources,
    backend: &str,
    device: &str,
    driver: &str,
) -> Result<(GemmChoice, ChoiceSource)> {
    if let Some(choice) = explicit {
        return Ok((choice, ChoiceSource::Options));
    }
    if let Some(setting) = sources.setting {
        return Ok((setting.over(default), ChoiceSource::Environment));
    }
    if let Some(path) = &sources.tune_cache {
        if let Some(choice) = TuneCache::load(path).lookup(backend, device, driver) {
            return Ok((choice, ChoiceSource::Cache(path.clone())));
        }
    }
    Ok((default, ChoiceSource::Default))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend default for the tests: K-64 logits, prefetching 256-row dx.
    const DEFAULT: GemmChoice = GemmChoice {
        logits: CoopGemm::Staged(tile(64, 2, 1, false)),
        dx: CoopGemm::Staged(tile(32, 4, 1, true)),
    };

    const H200: KernelLimits = KernelLimits::H200_SPIRV;

    fn parse(value: &str) -> Result<GemmChoice> {
        GemmChoice::parse(value, DEFAULT)
    }

    #[test]
    fn names_round_trip() {
        for kernel in CoopGemm::candidates() {
            assert_eq!(CoopGemm::parse(&kernel.to_string()).unwrap(), kernel);
        }
        let choice = GemmChoice {
            logits: CoopGemm::Staged(tile(64, 4, 1, true)),
            dx: CoopGemm::Direct,
        };
        assert_eq!(choice.to_string(), "logits=staged:bk64:r4:s1:pf,dx=direct");
        assert_eq!(parse(&choice.to_string()).unwrap(), choice);
        assert_eq!(
            parse("direct").unwrap(),
            GemmChoice {
                logits: CoopGemm::Direct,
                dx: CoopGemm::Direct
            }
        );
        assert_eq!(
            parse("dx=staged:s1:pf").unwrap().dx,
            CoopGemm::Staged(StagedTile {
                stages: 1,
                prefetch: true,
                ..DEFAULT_STAGED
            })
        );
    }

    #[test]
    fn glsl_tiles_are_named_like_the_other_kernels() {
        let split = parse("logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk32.s2").unwrap();
        assert_eq!(
            split.logits,
            CoopGemm::Glsl(GlslTile::from_name("bm128.bk64.s1").unwrap())
        );
        assert_eq!(split.to_string(), "logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk32.s2");
        assert_eq!(parse(&split.to_string()).unwrap(), split);
        // One side only: the other keeps the default's WGSL kernel.
        let dx = parse("dx=glsl:bm128.bk32.s2.ws.c4").unwrap();
        assert_eq!(dx.logits, DEFAULT.logits);
        assert_eq!(dx.dx.tile(), (128, 128));
        // 2 × 4 math subgroups and 4 copying ones.
        assert_eq!(dx.dx.invocations(32), 2 * 4 * 32 + 128);
        for t in GLSL_TILES {
            let k = CoopGemm::Glsl(t);
            assert!(CoopGemm::candidates().contains(&k), "{k}");
            assert_eq!(k.shared_bytes(), t.shared_bytes());
            assert!(k.overrides(32).is_empty());
        }
        // In `logits=KERNEL`, the error names the kernel part.
        for (bad, named) in [
            ("glsl:bm96.bk32.s2", "glsl:bm96.bk32.s2"),
            ("glsl:", "glsl:"),
            ("glsl:bm128.bk64.s3", "glsl:bm128.bk64.s3"),
            ("logits=glsl:staged", "glsl:staged"),
        ] {
            match parse(bad) {
                Err(Error::InvalidSetting { name, value, reason }) => {
                    assert_eq!((name, value.as_str()), (GEMM_ENV, named));
                    assert!(reason.contains("bm128.bk64.s1"), "{bad}: {reason}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn ptx_tiles_are_named_and_picked_only_where_they_run() {
        let choice = parse("logits=wgmma:bm64.bk64.s1,dx=wgmma:bm64.bk32.s3").unwrap();
        assert_eq!(choice, GemmChoice::WGMMA_DEFAULT);
        assert_eq!(parse(&choice.to_string()).unwrap(), choice);
        assert!(choice.uses_ptx() && !GemmChoice::GLSL_DEFAULT.uses_ptx());
        assert_eq!(choice.dx.tile(), (64, 128));
        assert_eq!(choice.dx.invocations(32), 128);
        assert_eq!(choice.dx.shared_bytes(), 3 * (64 + 128) * 32 * 2);
        for t in WGMMA_TILES {
            let tuned = CoopGemm::candidates().contains(&CoopGemm::Wgmma(t));
            assert_eq!(tuned, t.feed == crate::toolkit::WgmmaFeed::Copies, "{t}");
            assert_eq!(parse(&format!("wgmma:{t}")).unwrap().logits, CoopGemm::Wgmma(t));
        }
        match parse("wgmma:bm64.bk16.s3") {
            Err(Error::InvalidSetting { name, value, reason }) => {
                assert_eq!((name, value.as_str()), (GEMM_ENV, "wgmma:bm64.bk16.s3"));
                assert!(reason.contains("bm64.bk32.s3"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // Without the extension (wgpu, other drivers) they misfit: named by
        // the user, a typed error naming the tile; by default, the GLSL tiles.
        let why = choice.misfit(&H200).unwrap();
        assert!(
            why.contains("VK_NVX_binary_import") && why.contains("wgmma:bm64.bk64.s1"),
            "{why}"
        );
        assert!(fit_choice(DEFAULT, choice, ChoiceSource::Environment, &H200).is_err());
        assert_eq!(GemmChoice::default_for(DEFAULT, Some(&H200)), GemmChoice::GLSL_DEFAULT);
        assert_eq!(
            fit_choice(DEFAULT, DEFAULT, ChoiceSource::Default, &H200).unwrap().0,
            GemmChoice::GLSL_DEFAULT
        );
        // With it they are the default, and a cached choice that cannot run
        // falls back to them.
        let nvx = KernelLimits { ptx: true, ..H200 };
        assert_eq!(choice.misfit(&nvx), None);
        assert_eq!(GemmChoice::default_for(DEFAULT, Some(&nvx)), choice);
        assert_eq!(
            fit_choice(DEFAULT, DEFAULT, ChoiceSource::Default, &nvx).unwrap(),
            (choice, ChoiceSource::Default)
        );
        let wide = KernelLimits {
            subgroup_size: 64,
            ..nvx
        };
        let cached = ChoiceSource::Cache(PathBuf::from("gemm-tune.tsv"));
        assert_eq!(
            fit_choice(DEFAULT, GemmChoice::GLSL_DEFAULT, cached, &wide).unwrap(),
            (choice, ChoiceSource::Default)
        );
    }

    #[test]
    fn a_device_that_cannot_run_the_glsl_tiles_refuses_them() {
        let h200 = H200;
        let glsl = parse("logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk32.s2").unwrap();
        assert_eq!(glsl.logits.misfit(&h200), None);
        assert_eq!(
            fit_choice(DEFAULT, glsl, ChoiceSource::Environment, &h200).unwrap(),
            (glsl, ChoiceSource::Environment)
        );
        // wgpu without passthrough, a Vulkan 1.2 device; subgroups of 64.
        let no_spirv = KernelLimits { spirv: false, ..h200 };
        let wide = KernelLimits {
            subgroup_size: 64,
            ..h200
        };
        for (limits, says) in [(no_spirv, "PASSTHROUGH_SHADERS"), (wide, "subgroups of 32")] {
            let why = glsl.dx.misfit(&limits).unwrap();
            assert!(why.contains(says) && why.contains("glsl:bm128.bk32.s2"), "{why}");
            // Named by the user: a typed error; from the cache: the default.
            match fit_choice(DEFAULT, glsl, ChoiceSource::Options, &limits) {
                Err(Error::InvalidSetting { name, value, reason }) => {
                    assert_eq!((name, value), (GEMM_ENV, glsl.to_string()));
                    assert!(reason.contains(says), "{reason}");
                }
                other => panic!("{other:?}"),
            }
            let cached = fit_choice(DEFAULT, glsl, ChoiceSource::Cache(PathBuf::from("x")), &limits).unwrap();
            assert_eq!(cached, (DEFAULT, ChoiceSource::Default));
            // The WGSL kernels are unaffected.
            assert_eq!(DEFAULT.logits.misfit(&limits), None);
        }
    }

    #[test]
    fn bad_names_are_typed_errors_naming_the_value() {
        for bad in [
            "fast",
            "staged:bk24",
            "staged:r3",
            "staged:s3",
            "staged:s2:pf",
            "staged:x1",
            "staged:bk",
            "logits",
            "lm=direct",
        ] {
            match parse(bad) {
                Err(Error::InvalidSetting { name, value, .. }) => {
                    assert_eq!((name, value.as_str()), (GEMM_ENV, bad));
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn shared_memory_and_tiles() {
        let t = |bk, rows, stages| tile(bk, rows, stages, false);
        assert_eq!(t(16, 2, 1).shared_bytes(), 12 << 10);
        assert_eq!(t(32, 2, 2).shared_bytes(), 40 << 10);
        assert_eq!(t(32, 4, 2).shared_bytes(), 60 << 10);
        assert_eq!(CoopGemm::Staged(t(16, 4, 2)).tile(), (256, 128));
        assert_eq!(CoopGemm::Staged(t(16, 4, 2)).invocations(32), 256);
        assert_eq!(CoopGemm::Direct.shared_bytes(), 0);
        assert_eq!(t(64, 2, 1).shared_bytes(), 36 << 10);
        // The PTX copy tiles; not the bulk ones.
        assert_eq!(CoopGemm::candidates().len(), 19 + GLSL_TILES.len() + 3);
    }

    #[test]
    fn switching_to_a_kernel_that_does_not_fit_names_why() {
        let glsl = GemmChoice::GLSL_DEFAULT;
        assert!(glsl.check_use("H200", Some(&H200)).is_ok());
        let wide = KernelLimits {
            subgroup_size: 64,
            ..H200
        };
        for (limits, says) in [(Some(&wide), "subgroups of 32"), (None, "lavapipe runs the tiled GEMM")] {
            match glsl.check_use("lavapipe", limits) {
                Err(Error::InvalidSetting { name, value, reason }) => {
                    assert_eq!((name, value), (GEMM_ENV, glsl.to_string()));
                    assert!(reason.contains(says), "{reason}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_kernel_that_does_not_fit_is_an_error_only_when_asked_for() {
        let h200 = H200;
        // 60 KiB of workgroup memory on a 48 KiB device.
        let big = parse("logits=staged:bk32:r4:s2,dx=direct").unwrap();
        match fit_choice(DEFAULT, big, ChoiceSource::Environment, &h200) {
            Err(Error::InvalidSetting { value, reason, .. }) => {
                assert_eq!(value, big.to_string());
                assert!(reason.contains("61440 bytes"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // A cache entry that does not fit falls back to the default: the GLSL
        // tiles where they run, else the backend's.
        let fitted = fit_choice(DEFAULT, big, ChoiceSource::Cache(PathBuf::from("x")), &h200).unwrap();
        assert_eq!(fitted, (GemmChoice::GLSL_DEFAULT, ChoiceSource::Default));
        let no_spirv = KernelLimits { spirv: false, ..h200 };
        let fitted = fit_choice(DEFAULT, big, ChoiceSource::Cache(PathBuf::from("x")), &no_spirv).unwrap();
        assert_eq!(fitted, (DEFAULT, ChoiceSource::Default));
        // The default itself: GLSL where it runs; the backend's on subgroups
        // of 64 or without SPIR-V passthrough.
        let default = fit_choice(DEFAULT, DEFAULT, ChoiceSource::Default, &h200).unwrap();
        assert_eq!(default, (GemmChoice::GLSL_DEFAULT, ChoiceSource::Default));
        assert_eq!(
            GemmChoice::GLSL_DEFAULT.to_string(),
            "logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk64.s1"
        );
        let wide = KernelLimits {
            subgroup_size: 64,
            ..h200
        };
        for limits in [no_spirv, wide] {
            let default = fit_choice(DEFAULT, DEFAULT, ChoiceSource::Default, &limits).unwrap();
            assert_eq!(default, (DEFAULT, ChoiceSource::Default));
        }
        // Naming one GEMM keeps the device's default for the other.
        let h200_default = GemmChoice::default_for(DEFAULT, Some(&h200));
        assert_eq!(h200_default, GemmChoice::GLSL_DEFAULT);
        assert_eq!(GemmChoice::default_for(DEFAULT, Some(&no_spirv)), DEFAULT);
        assert_eq!(GemmChoice::default_for(DEFAULT, None), DEFAULT);
        let dx_only = GemmChoice::parse("dx=staged:bk32:r4:s1:pf", h200_default).unwrap();
        assert_eq!(dx_only.logits, GemmChoice::GLSL_DEFAULT.logits);
        // A fitting cache entry or explicit choice is kept.
        let ok = parse("staged:bk32:r2:s2").unwrap();
        assert_eq!(fit_choice(DEFAULT, ok, ChoiceSource::Options, &h200).unwrap().0, ok);
        let cached = fit_choice(DEFAULT, ok, ChoiceSource::Cache(PathBuf::from("x")), &h200).unwrap();
        assert_eq!(cached.0, ok);

        // Too little for the default too: the direct kernel everywhere.
        let small = KernelLimits {
            shared_bytes: 4 << 10,
            ..h200
        };
        let fitted = fit_choice(DEFAULT, big, ChoiceSource::Default, &small).unwrap();
        assert_eq!(fitted.0, parse("direct").unwrap());

        // Subgroup builtins and invocations.
        let no_builtins = KernelLimits {
            subgroup_builtins: false,
            ..h200
        };
        assert!(CoopGemm::parse("staged").unwrap().misfit(&no_builtins).is_some());
        assert_eq!(CoopGemm::Direct.misfit(&no_builtins), None);
        let few = KernelLimits {
            invocations: 128,
            ..h200
        };
        assert!(CoopGemm::parse("staged:r4").unwrap().misfit(&few).is_some());
        assert_eq!(CoopGemm::parse("staged:r2").unwrap().misfit(&few), None);
    }
}
