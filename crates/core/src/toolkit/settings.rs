//! Every `HEADKL_*` environment variable, in one list, and the typed
//! sections their consumers parse them into.
//!
//! The list [`VARIABLES`] is where the README's table and `headkl --help`'s
//! environment section come from. Each consumer owns its section and parses
//! it from an [`Env`] (the process environment, or a map in a test) once:
//! core the options common to both GPU backends ([`CommonOptions`]), each
//! backend its own switches (`VulkanOptions::from_env`), the test crate the
//! suite's (`headkl_conformance::SuiteSettings`), the command
//! line its own (backend, trace, dx split, bench shape). The libraries never
//! read the environment themselves: their callers pass options down.
//!
//! One rule for switches: `1`, `true`, `yes`, `on` are on; empty, `0`,
//! `false`, `no`, `off` are off (any case); anything else is an error
//! naming the variable, so a typo never goes unnoticed.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::toolkit::gemm_choice::{GemmChoice, GemmSetting};
use crate::toolkit::queue::QueueChoice;
use crate::toolkit::tune_cache::CACHE_FILE;

/// The `log` target of the diagnostics a user switches on
/// (`HEADKL_TRACE`'s phases, `HEADKL_PIPELINE_STATS`' statistics), logged
/// at info level: a program that is otherwise quiet can still let them
/// through, since they were asked for.
pub const DIAGNOSTICS_LOG_TARGET: &str = "headkl::diagnostics";

/// One environment variable: its name, the values it takes, its default and
/// what it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variable {
    /// The name, e.g. `HEADKL_DEVICE`.
    pub name: &'static str,
    /// The values it takes, in words or as a pattern.
    pub values: &'static str,
    /// What applies when it is unset.
    pub default: &'static str,
    /// What it does, in one line.
    pub effect: &'static str,
}

/// `HEADKL_BACKEND`.
pub const BACKEND: &str = "HEADKL_BACKEND";
/// `HEADKL_CUSTOM_OPS` (read by the PyTorch package).
pub const CUSTOM_OPS: &str = "HEADKL_CUSTOM_OPS";
/// `HEADKL_DEVICE`.
pub const DEVICE: &str = "HEADKL_DEVICE";
/// `HEADKL_REQUIRE`.
pub const REQUIRE: &str = "HEADKL_REQUIRE";
/// `HEADKL_CASES`.
pub const CASES: &str = "HEADKL_CASES";
/// `HEADKL_SEED`.
pub const SEED: &str = "HEADKL_SEED";
/// `HEADKL_NO_COOPMAT`.
pub const NO_COOPMAT: &str = "HEADKL_NO_COOPMAT";
/// `HEADKL_GEMM`.
pub const GEMM: &str = crate::toolkit::gemm_choice::GEMM_ENV;
/// `HEADKL_CACHE_DIR`.
pub const CACHE_DIR: &str = crate::toolkit::tune_cache::CACHE_DIR_ENV;
/// `HEADKL_TRACE`.
pub const TRACE: &str = "HEADKL_TRACE";
/// `HEADKL_PIPELINE_STATS`.
pub const PIPELINE_STATS: &str = "HEADKL_PIPELINE_STATS";
/// `HEADKL_VALIDATION`.
pub const VALIDATION: &str = "HEADKL_VALIDATION";
/// `HEADKL_CHECKED`.
pub const CHECKED: &str = "HEADKL_CHECKED";
/// `HEADKL_BENCH_SHAPE`.
pub const BENCH_SHAPE: &str = "HEADKL_BENCH_SHAPE";
/// `HEADKL_DX_SPLIT`.
pub const DX_SPLIT: &str = "HEADKL_DX_SPLIT";
/// `HEADKL_QUEUE`.
pub const QUEUE: &str = "HEADKL_QUEUE";
/// `HEADKL_COPY_QUEUE`.
pub const COPY_QUEUE: &str = "HEADKL_COPY_QUEUE";
/// `HEADKL_NO_ROW_STATS`.
pub const NO_ROW_STATS: &str = "HEADKL_NO_ROW_STATS";

/// Every `HEADKL_*` variable headkl reads, in the order the docs list them.
pub const VARIABLES: &[Variable] = &[
    Variable {
        name: BACKEND,
        values: "auto|cuda|vulkan|wgpu|reference",
        default: "auto",
        effect: "the command's backend (`--backend` wins)",
    },
    Variable {
        name: DEVICE,
        values: "N",
        default: "auto's pick",
        effect: "device index within the backend, as `headkl devices` lists them (`--device` wins)",
    },
    Variable {
        name: REQUIRE,
        values: "comma list, e.g. wgpu,vulkan",
        default: "none",
        effect: "a named backend that cannot start fails `check` and the tests instead of being skipped",
    },
    Variable {
        name: CASES,
        values: "N",
        default: "16",
        effect: "drawn conformance cases per backend (`check --cases` wins)",
    },
    Variable {
        name: SEED,
        values: "decimal or 0x hex",
        default: "0x484541444b4c0001",
        effect: "seed of the drawn conformance cases; a failure prints the one to replay (`check --seed` wins)",
    },
    Variable {
        name: NO_COOPMAT,
        values: "switch",
        default: "off",
        effect: "the tiled fallback GEMM even on a device with matrix units (listings say so too)",
    },
    Variable {
        name: GEMM,
        values: "KERNEL or logits=KERNEL,dx=KERNEL; KERNEL: direct, staged:bk<16|32|64>:r<2|4>:s<1|2>[:pf], glsl:bm<64|128|256>.bk<16|32|64>.s<1|2|4>[.i][.ws][.c4] (the GLSL tiles of shaders/gemm_khr.comp) or wgmma:bm64.bk32.s3, wgmma:bm64.bk64.s1, wgmma:bm128.bk32.s2, wgmma:bulk.bm64.bn256.bk16.s4 (the PTX tiles of shaders/gemm_wgmma.cu; bulk: fed from packed operands, picked only here, not by tune)",
        default: "the tune cache's entry, else logits=wgmma:bm64.bk64.s1,dx=wgmma:bm64.bk32.s3 where the Vulkan backend launches the PTX tiles, else glsl:bm128.bk64.s1 where the device runs the GLSL tiles, else the backend's WGSL pair",
        effect: "the matrix-unit GEMM kernels (K per step, rows of subgroups, stages, register prefetch; glsl: needs subgroups of 32 and Vulkan 1.3, or wgpu with PASSTHROUGH_SHADERS; wgmma: the Vulkan backend with VK_NVX_binary_import on an NVIDIA Hopper GPU); the CUDA backend's GEMMs are cuBLASLt's, which this does not change",
    },
    Variable {
        name: DX_SPLIT,
        values: "auto or 1..16",
        default: "auto",
        effect: "split-K parts of the dx GEMM per vocabulary slice; auto: the fewest whose workgroups reach 1300, parts of at least 4096, 1 without matrix units",
    },
    Variable {
        name: NO_ROW_STATS,
        values: "switch",
        default: "off",
        effect: "head_kl's KL rows fold each row's logits themselves instead of taking the row statistics (max and sum of exponentials per 32 columns) that the logits GEMM writes, so they read the logits twice instead of once (`Engine::set_row_stats`; the statistics are used only with no softcap, τ = 1 and no hard label); Vulkan and wgpu only: cuBLASLt writes no such statistics, so on the CUDA backend the KL rows always read the logits twice",
    },
    Variable {
        name: QUEUE,
        values: "auto|universal|N",
        default: "auto",
        effect: "the queue family both GPU backends open their device on; auto: one with compute and without graphics where there is one (on NVIDIA the graphics family runs the GEMMs up to 2.6× slower); universal: the graphics family, as wgpu picks on its own; N: that family",
    },
    Variable {
        name: COPY_QUEUE,
        values: "auto|off|compute",
        default: "auto",
        effect: "Vulkan backend: where the host path's large uploads and downloads run; auto: on a transfer-only queue family beside the kernels where the device has one (and timeline semaphores), else in line on the kernels' queue; off: in line; compute: in submissions of their own on the kernels' queue (for tests)",
    },
    Variable {
        name: CACHE_DIR,
        values: "folder",
        default: "$XDG_CACHE_HOME/headkl, else ~/.cache/headkl",
        effect: "where `headkl tune` keeps its cache (gemm-tune.tsv), and where the Vulkan backend marks PTX tiles that failed on a device",
    },
    Variable {
        name: TRACE,
        values: "switch",
        default: "off",
        effect: "log each head_kl call's host phases (upload, wait, download; a shard engine's two phases) at info level (the command prints them on stderr)",
    },
    Variable {
        name: PIPELINE_STATS,
        values: "switch",
        default: "off",
        effect: "Vulkan backend: log each pipeline's registers and memory (VK_KHR_pipeline_executable_properties) at info level",
    },
    Variable {
        name: VALIDATION,
        values: "switch",
        default: "off",
        effect: "Vulkan backend: load the Khronos validation layer and fail on its errors",
    },
    Variable {
        name: CHECKED,
        values: "switch",
        default: "off",
        effect: "build every kernel with runtime bounds checks (the GEMMs go without them by default)",
    },
    Variable {
        name: BENCH_SHAPE,
        values: "A|B|small",
        default: "small",
        effect: "the shape `cargo bench -p headkl-cli` times",
    },
    Variable {
        name: CUSTOM_OPS,
        values: "0|1",
        default: "1",
        effect: "the PyTorch package: 0 runs the losses through its autograd.Function instead of torch.library custom ops",
    },
];

/// Variables headkl no longer reads, with what to say instead: setting one
/// is an error rather than a silent no-op.
pub const REMOVED: [(&str, &str); 1] = [(
    "HEADKL_GLSL_GEMM",
    "the GLSL tiles are HEADKL_GEMM kernels now: HEADKL_GEMM=logits=glsl:TILE,dx=glsl:TILE",
)];

/// The environment the variables are read from: the process's, or given
/// pairs (a test's). Reading it changes nothing.
pub struct Env {
    vars: Option<HashMap<String, OsString>>,
}

impl Env {
    /// The process environment.
    pub fn process() -> Self {
        Self { vars: None }
    }

    /// Only these variables (a test's environment).
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self {
            vars: Some(
                pairs
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), OsString::from(v)))
                    .collect(),
            ),
        }
    }

    fn raw(&self, name: &str) -> Option<OsString> {
        match &self.vars {
            None => std::env::var_os(name),
            Some(vars) => vars.get(name).cloned(),
        }
    }

    /// `name`'s value, `None` when unset or blank; not UTF-8 is an error.
    pub fn text(&self, name: &'static str) -> Result<Option<String>> {
        match self.raw(name) {
            None => Ok(None),
            Some(raw) => match raw.into_string() {
                Ok(s) if s.trim().is_empty() => Ok(None),
                Ok(s) => Ok(Some(s)),
                Err(raw) => Err(invalid(name, &raw.to_string_lossy(), "not UTF-8")),
            },
        }
    }

    /// A switch under the one rule (see the module docs); off when unset.
    pub fn flag(&self, name: &'static str) -> Result<bool> {
        self.text(name)?.map_or(Ok(false), |v| parse_flag(name, &v))
    }

    /// A non-negative number, decimal or `0x` hex.
    pub fn number(&self, name: &'static str) -> Result<Option<u64>> {
        self.text(name)?.map(|v| parse_number(name, &v)).transpose()
    }

    /// A count or index.
    pub fn count(&self, name: &'static str) -> Result<Option<usize>> {
        match self.text(name)? {
            None => Ok(None),
            Some(v) => {
                let n = parse_number(name, &v)?;
                usize::try_from(n).map(Some).map_err(|_| invalid(name, &v, "too large"))
            }
        }
    }

    /// An error for each variable of [`REMOVED`] that is set.
    pub fn check_removed(&self) -> Result<()> {
        for (name, instead) in REMOVED {
            if let Some(value) = self.text(name)? {
                return Err(invalid(name, &value, &format!("no longer read: {instead}")));
            }
        }
        Ok(())
    }

    /// The tune cache file: `HEADKL_CACHE_DIR`, else `$XDG_CACHE_HOME/headkl`,
    /// else `$HOME/.cache/headkl`, then [`CACHE_FILE`]; `None` without any.
    pub fn tune_cache(&self) -> Result<Option<PathBuf>> {
        let path = |name: &'static str| self.text(name).ok().flatten().map(PathBuf::from);
        Ok(self
            .text(CACHE_DIR)?
            .map(PathBuf::from)
            .or_else(|| path("XDG_CACHE_HOME").map(|d| d.join("headkl")))
            .or_else(|| path("HOME").map(|d| d.join(".cache").join("headkl")))
            .map(|d| d.join(CACHE_FILE)))
    }
}

/// What both GPU backends take when they open a device, under the same
/// names in each backend's options (`OpenOptions::common`,
/// `VulkanOptions::common`). `Default` is the value with no variable set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommonOptions {
    /// The device's index in the backend's list (`HEADKL_DEVICE`); `None`:
    /// the best usable one.
    pub device: Option<usize>,
    /// The tiled fallback GEMM even where matrix units exist
    /// (`HEADKL_NO_COOPMAT`).
    pub force_fallback: bool,
    /// Build every kernel with runtime bounds checks (`HEADKL_CHECKED`);
    /// the GEMMs go without them by default: core validated every extent.
    pub checked: bool,
    /// The matrix-unit GEMM kernels; `None`: `gemm_sources` (`HEADKL_GEMM`,
    /// else the tune cache's entry for the device), else the backend's
    /// default. Explicit options win over the environment's.
    pub gemm: Option<GemmChoice>,
    /// `HEADKL_GEMM` and the tune cache, consulted when `gemm` is `None`.
    pub gemm_sources: GemmSources,
    /// The queue family to open the device on (`HEADKL_QUEUE`). A trainer's
    /// device keeps its own.
    pub queue: QueueChoice,
}

impl CommonOptions {
    /// `HEADKL_DEVICE`, `HEADKL_NO_COOPMAT`, `HEADKL_CHECKED`,
    /// `HEADKL_QUEUE`, and `HEADKL_GEMM` with the tune cache as the GEMM's
    /// sources; a value that does not parse is [`Error::InvalidSetting`]
    /// naming it.
    pub fn from_env(env: &Env) -> Result<Self> {
        env.check_removed()?;
        Ok(Self {
            device: env.count(DEVICE)?,
            force_fallback: env.flag(NO_COOPMAT)?,
            checked: env.flag(CHECKED)?,
            gemm: None,
            gemm_sources: GemmSources {
                setting: env.text(GEMM)?.map(|v| GemmSetting::parse(&v)).transpose()?,
                tune_cache: env.tune_cache()?,
            },
            queue: env
                .text(QUEUE)?
                .map(|v| QueueChoice::parse(QUEUE, &v))
                .transpose()?
                .unwrap_or_default(),
        })
    }
}

/// Where a backend's GEMM choice can come from besides its open options:
/// `HEADKL_GEMM` and the tune cache (see [`crate::toolkit::gemm_choice::resolve_choice`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GemmSources {
    /// `HEADKL_GEMM`, parsed; laid over the backend's default by
    /// [`crate::toolkit::gemm_choice::resolve_choice`].
    pub setting: Option<GemmSetting>,
    /// The tune cache file, if there is a place for one.
    pub tune_cache: Option<PathBuf>,
}

/// A switch's value under the one rule (see the module docs).
pub fn parse_flag(name: &'static str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(invalid(name, value, "expected 1/true/yes/on or 0/false/no/off")),
    }
}

/// A non-negative number, decimal or `0x` hex.
pub fn parse_number(name: &'static str, value: &str) -> Result<u64> {
    let t = value.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    }
    .map_err(|e| invalid(name, value, &format!("not a number ({e}; decimal or 0x hex)")))
}

/// The error for `name`'s `value`, and why.
pub fn invalid(name: &'static str, value: &str, reason: &str) -> Error {
    Error::InvalidSetting {
        name,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// The variables as the README's Markdown table (header included).
pub fn markdown_table() -> String {
    let mut out = String::from("| variable | values | default | effect |\n| --- | --- | --- | --- |\n");
    for v in VARIABLES {
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            v.name,
            v.values.replace('|', "\\|"),
            v.default,
            v.effect
        ));
    }
    out
}

/// The variables as `--help` text, one entry per variable.
pub fn help_text() -> String {
    let mut out = String::from("Environment (switches: 1/true/yes/on or 0/false/no/off):\n");
    for v in VARIABLES {
        out.push_str(&format!(
            "  {}={}\n      {}; default: {}\n",
            v.name, v.values, v.effect, v.default
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(vars: &[(&str, &str)]) -> Result<CommonOptions> {
        CommonOptions::from_env(&Env::from_pairs(vars.iter().copied()))
    }

    #[test]
    fn nothing_set_is_the_default() {
        assert_eq!(common(&[]).unwrap(), CommonOptions::default());
    }

    #[test]
    fn one_rule_for_switches() {
        for on in ["1", "true", "YES", " on "] {
            assert!(common(&[(NO_COOPMAT, on)]).unwrap().force_fallback, "{on}");
        }
        for off in ["0", "false", "No", "off", ""] {
            assert!(!common(&[(CHECKED, off)]).unwrap().checked, "{off}");
        }
        let e = Env::from_pairs([(VALIDATION, "maybe")]).flag(VALIDATION).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidSetting { name, .. } if *name == VALIDATION),
            "{e}"
        );
    }

    #[test]
    fn common_options_parse_and_bad_values_name_them() {
        let c = common(&[
            (DEVICE, "2"),
            (GEMM, "direct"),
            (CACHE_DIR, "/tmp/x"),
            (QUEUE, "universal"),
        ])
        .unwrap();
        assert_eq!(c.device, Some(2));
        // Parsed once, into the kernel for each layout.
        let direct = Some(crate::toolkit::CoopGemm::Direct);
        assert_eq!(
            c.gemm_sources.setting,
            Some(GemmSetting {
                logits: direct,
                dx: direct
            })
        );
        let dx_only = common(&[(GEMM, "dx=direct")]).unwrap().gemm_sources.setting;
        assert_eq!(
            dx_only,
            Some(GemmSetting {
                logits: None,
                dx: direct
            })
        );
        assert_eq!(
            c.gemm_sources.tune_cache,
            Some(PathBuf::from("/tmp/x").join(CACHE_FILE))
        );
        assert_eq!(c.queue, QueueChoice::Universal);
        for (name, bad) in [
            (DEVICE, "first"),
            (GEMM, "garbage"),
            (GEMM, "logits=direct,up=direct"),
            (QUEUE, "gfx"),
        ] {
            let e = common(&[(name, bad)]).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(name) && text.contains(bad), "{name}={bad}: {text}");
        }
        let e = Env::from_pairs([(SEED, "0xzz")]).number(SEED).unwrap_err().to_string();
        assert!(e.contains(SEED) && e.contains("0xzz"), "{e}");
        assert_eq!(Env::from_pairs([(SEED, "0x11")]).number(SEED).unwrap(), Some(17));
    }

    #[test]
    fn a_removed_variable_is_an_error_that_says_what_replaced_it() {
        match common(&[("HEADKL_GLSL_GEMM", "logits=bm128.bk64.s1")]) {
            Err(Error::InvalidSetting { name, value, reason }) => {
                assert_eq!((name, value.as_str()), ("HEADKL_GLSL_GEMM", "logits=bm128.bk64.s1"));
                assert!(reason.contains("HEADKL_GEMM=logits=glsl:"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        for (name, _) in REMOVED {
            assert!(
                VARIABLES.iter().all(|v| v.name != name),
                "{name} is both read and removed"
            );
        }
    }

    #[test]
    fn cache_path_falls_back_to_xdg_then_home() {
        let env = Env::from_pairs([("XDG_CACHE_HOME", "/c"), ("HOME", "/h")]);
        assert_eq!(
            env.tune_cache().unwrap(),
            Some(PathBuf::from("/c/headkl").join(CACHE_FILE))
        );
        let env = Env::from_pairs([("HOME", "/h")]);
        assert_eq!(
            env.tune_cache().unwrap(),
            Some(PathBuf::from("/h/.cache/headkl").join(CACHE_FILE))
        );
        assert_eq!(Env::from_pairs([]).tune_cache().unwrap(), None);
    }

    #[test]
    fn readme_table_is_the_list() {
        let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"));
        let table = markdown_table();
        assert!(
            readme.contains(&table),
            "README.md's variable table differs from settings::VARIABLES; paste this:\n{table}"
        );
        // No variable the list lacks is documented there either.
        for word in readme.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("HEADKL_") && word != "HEADKL_" {
                assert!(
                    VARIABLES.iter().any(|v| v.name == word),
                    "README names {word}, not in the list"
                );
            }
        }
    }

    /// `HEADKL_GEMM`'s documented default names the PTX and GLSL defaults,
    /// and its values every PTX tile.
    #[test]
    fn gemm_default_names_the_glsl_default() {
        let gemm = VARIABLES.iter().find(|v| v.name == GEMM).unwrap();
        let tile = crate::toolkit::GemmChoice::GLSL_DEFAULT;
        assert_eq!(tile.logits, tile.dx);
        assert!(gemm.default.contains(&tile.logits.to_string()), "{}", gemm.default);
        assert!(
            gemm.default
                .contains(&crate::toolkit::GemmChoice::WGMMA_DEFAULT.to_string()),
            "{}",
            gemm.default
        );
        for t in crate::toolkit::wgmma_tile::WGMMA_TILES {
            assert!(gemm.values.contains(&format!("wgmma:{t}")), "{}", gemm.values);
        }
    }

    /// Explicit options beat `HEADKL_GEMM`, which beats the tune cache,
    /// which beats the backend's default.
    #[test]
    fn gemm_choice_precedence() {
        use crate::toolkit::gemm_choice::{resolve_choice, ChoiceSource, CoopGemm};
        use crate::toolkit::tune_cache::TuneCache;
        let dir = std::env::temp_dir().join(format!("headkl-settings-gemm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cache_file = dir.join(CACHE_FILE);
        let all = CoopGemm::candidates();
        let one = |k: CoopGemm| GemmChoice { logits: k, dx: k };
        let (explicit, setting, cached) = (one(all[0]), one(all[1]), one(all[2]));
        let default = GemmChoice::PORTABLE;
        let mut cache = TuneCache::load(&cache_file);
        cache.insert("vulkan", "dev", "drv", cached);
        cache.save(&cache_file).unwrap();
        let sources = GemmSources {
            setting: Some(GemmSetting {
                logits: Some(setting.logits),
                dx: Some(setting.dx),
            }),
            tune_cache: Some(cache_file.clone()),
        };
        let pick = |e, s: &GemmSources| resolve_choice(e, default, s, "vulkan", "dev", "drv").unwrap();
        assert_eq!(pick(Some(explicit), &sources), (explicit, ChoiceSource::Options));
        assert_eq!(pick(None, &sources), (setting, ChoiceSource::Environment));
        let cache_only = GemmSources {
            setting: None,
            ..sources.clone()
        };
        assert_eq!(
            pick(None, &cache_only),
            (cached, ChoiceSource::Cache(cache_file.clone()))
        );
        assert_eq!(pick(None, &GemmSources::default()), (default, ChoiceSource::Default));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn docs_list_every_variable_once() {
        let table = markdown_table();
        let help = help_text();
        for v in VARIABLES {
            assert_eq!(table.matches(&format!("`{}`", v.name)).count(), 1, "{}", v.name);
            assert_eq!(help.matches(&format!("  {}=", v.name)).count(), 1, "{}", v.name);
        }
    }
}
