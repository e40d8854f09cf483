//! Finding NVIDIA's libraries at run time: the driver's `libcuda.so.1` and
//! cuBLASLt.
//!
//! cudarc loads each by name only (the `cuda-13000` build asks for
//! `libcublasLt.so.13`, then `.so.12`, ...), which finds a library the
//! dynamic loader's cache or `LD_LIBRARY_PATH` knows. Many machines keep
//! cuBLASLt elsewhere: CUDA's own folder (`/usr/local/cuda/lib64` is often
//! not in the cache), or the `nvidia` wheels PyTorch brings. So where the
//! name alone finds nothing, this module looks in those places and loads
//! the library by its path; the loader then resolves cudarc's name to the
//! copy already in the process (a library is known by its soname). One
//! build thus runs with CUDA 12's cuBLASLt or 13's.
//!
//! Only standard variables are read (`CUDA_HOME`, `CUDA_PATH`,
//! `VIRTUAL_ENV`, `CONDA_PREFIX`, `PATH`): where other tools already say
//! where CUDA and Python live.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The cuBLASLt sonames headkl accepts, newest first.
pub const CUBLASLT_NAMES: [&str; 2] = ["libcublasLt.so.13", "libcublasLt.so.12"];

/// What loading found: `Ok` with where cuBLASLt came from, or why the
/// backend cannot start (which library, where it looked, how to install it).
pub fn load() -> Result<&'static str, String> {
    static LOADED: OnceLock<Result<String, String>> = OnceLock::new();
    LOADED.get_or_init(load_once).as_deref().map_err(Clone::clone)
}

fn load_once() -> Result<String, String> {
    // SAFETY: loading the driver library runs its initializers, which is
    // what every CUDA program does; nothing else is called yet.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no NVIDIA driver: the dynamic loader found no libcuda.so.1 \
                    (install the NVIDIA driver; a machine without an NVIDIA GPU has none)"
            .to_string());
    }
    // SAFETY: as above, for cuBLASLt found by name.
    if unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Ok("cuBLASLt from the dynamic loader's search path".to_string());
    }
    let dirs = search_dirs();
    for dir in &dirs {
        for name in CUBLASLT_NAMES {
            let path = dir.join(name);
            if !path.is_file() {
                continue;
            }
            match preload(&path) {
                // SAFETY: as above; the library is now in the process under
                // its soname, which is one of cudarc's names.
                Ok(()) if unsafe { cudarc::cublaslt::sys::is_culib_present() } => {
                    return Ok(format!("cuBLASLt from {}", path.display()));
                }
                Ok(()) => log::warn!("{} loaded but cudarc still does not find it", path.display()),
                Err(e) => log::warn!("{} did not load: {e}", path.display()),
            }
        }
    }
    let looked: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    Err(format!(
        "no cuBLASLt ({}): not on the dynamic loader's path, nor in {}. Install CUDA 12 or 13 \
         (and set CUDA_HOME), or `pip install nvidia-cublas-cu12`, or add its folder to LD_LIBRARY_PATH",
        CUBLASLT_NAMES.join(" or "),
        if looked.is_empty() {
            "any known folder".to_string()
        } else {
            looked.join(", ")
        }
    ))
}

/// Loads `path` for the rest of the process, its symbols global (so a
/// later load by soname finds this copy).
fn preload(path: &Path) -> Result<(), libloading::Error> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading cuBLASLt runs its initializers, as any program
    // linked against it does.
    let library = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL)? };
    // Never unloaded: cudarc's symbols point into it for the process's life.
    std::mem::forget(library);
    Ok(())
}

/// Folders that may hold cuBLASLt, most specific first, each once.
pub fn search_dirs() -> Vec<PathBuf> {
    let env = |name: &str| std::env::var_os(name).map(PathBuf::from);
    let mut dirs: Vec<PathBuf> = Vec::new();
    for root in [env("CUDA_HOME"), env("CUDA_PATH")].into_iter().flatten() {
        dirs.push(root.join("lib64"));
        dirs.push(root.join("lib"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.extend(glob_dirs(Path::new("/usr/local"), "cuda-", "lib64"));
    // Python environments: the active one, conda's, and each python3 on PATH.
    let mut prefixes: Vec<PathBuf> = [env("VIRTUAL_ENV"), env("CONDA_PREFIX")]
        .into_iter()
        .flatten()
        .collect();
    if let Some(path) = std::env::var_os("PATH") {
        for bin in std::env::split_paths(&path) {
            if bin.join("python3").exists() {
                if let Some(prefix) = bin.parent() {
                    prefixes.push(prefix.to_path_buf());
                }
            }
        }
    }
    if let Some(home) = env("HOME") {
        prefixes.push(home.join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    for prefix in prefixes {
        if prefix.join("lib").is_dir() {
            dirs.push(prefix.join("lib"));
        }
        for python in glob_dirs(&prefix.join("lib"), "python3", "") {
            for packages in ["site-packages", "dist-packages"] {
                let nvidia = python.join(packages).join("nvidia");
                // CUDA 13's wheels share one folder; CUDA 12's keep cuBLAS apart.
                dirs.push(nvidia.join("cu13").join("lib"));
                dirs.push(nvidia.join("cublas").join("lib"));
            }
        }
    }
    let mut seen = Vec::new();
    dirs.retain(|d| {
        d.is_dir() && !seen.contains(d) && {
            seen.push(d.clone());
            true
        }
    });
    dirs
}

/// `parent/<name starting with prefix>/sub` for each such folder, in name
/// order.
fn glob_dirs(parent: &Path, prefix: &str, sub: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| if sub.is_empty() { e.path() } else { e.path().join(sub) })
        .collect();
    found.sort();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_dirs_exist_and_are_listed_once() {
        let dirs = search_dirs();
        for (i, d) in dirs.iter().enumerate() {
            assert!(d.is_dir(), "{}", d.display());
            assert!(!dirs[..i].contains(d), "{} twice", d.display());
        }
    }

    #[test]
    fn glob_finds_prefixed_folders_in_order() {
        let root = std::env::temp_dir().join(format!("headkl-cuda-glob-{}", std::process::id()));
        for name in ["python3.12", "python3.10", "other"] {
            std::fs::create_dir_all(root.join(name).join("x")).unwrap();
        }
        let found = glob_dirs(&root, "python3", "x");
        assert_eq!(found, vec![root.join("python3.10/x"), root.join("python3.12/x")]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
