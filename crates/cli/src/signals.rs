//! Signals: SIGINT/SIGTERM remove the temporary output files in flight
//! before the process dies of the signal, and SIGPIPE ends the process
//! quietly (a closed pipe, as in `headkl devices --json | head -1`, is not
//! an error worth a panic). Unix only: elsewhere nothing is installed and
//! an interrupted run may leave its temporary file (the error paths still
//! remove it).

use std::ffi::c_char;
#[cfg(unix)]
use std::ffi::c_int;
#[cfg(unix)]
use std::ffi::CString;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};
#[cfg(unix)]
use std::sync::Once;

/// Temporary files the handler removes; a slot holds a leaked C string
/// (never freed, so the handler cannot read freed memory; a process makes
/// a handful).
static PENDING: [AtomicPtr<c_char>; 8] = [const { AtomicPtr::new(std::ptr::null_mut()) }; 8];

/// A registered temporary file: unregistered on drop.
pub struct Registered(Option<usize>);

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(slot) = self.0 {
            PENDING[slot].store(std::ptr::null_mut(), Ordering::SeqCst);
        }
    }
}

/// Removes `path` if the process gets SIGINT or SIGTERM while the returned
/// guard lives. With every slot taken the file is not covered (the normal
/// error path still removes it).
#[cfg(not(unix))]
pub fn remove_on_signal(_path: &Path) -> Registered {
    Registered(None)
}

/// Removes `path` if the process gets SIGINT or SIGTERM while the returned
/// guard lives. With every slot taken the file is not covered (the normal
/// error path still removes it).
#[cfg(unix)]
pub fn remove_on_signal(path: &Path) -> Registered {
    install();
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return Registered(None);
    };
    let raw = c.into_raw();
    for (i, slot) in PENDING.iter().enumerate() {
        if slot
            .compare_exchange(std::ptr::null_mut(), raw, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return Registered(Some(i));
        }
    }
    // SAFETY: `raw` came from `CString::into_raw` above and was not stored.
    drop(unsafe { CString::from_raw(raw) });
    Registered(None)
}

#[cfg(unix)]
extern "C" fn on_terminate(sig: c_int) {
    for slot in &PENDING {
        let p = slot.load(Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: `p` is a leaked, NUL-terminated C string; unlink is
            // async-signal-safe.
            unsafe { libc::unlink(p) };
        }
    }
    // SAFETY: restoring the default action and re-raising are
    // async-signal-safe; the process then ends with the signal's status.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Installs the handlers once: SIGINT and SIGTERM clean up, SIGPIPE takes
/// its default action (end quietly) instead of Rust's "ignore", which turns
/// a closed stdout into a panic in `println!`.
#[cfg(unix)]
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let handler = on_terminate as extern "C" fn(c_int) as libc::sighandler_t;
        // SAFETY: installing handlers for standard signals; the handler only
        // calls async-signal-safe functions.
        unsafe {
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    });
}

/// Nothing to install off Unix.
#[cfg(not(unix))]
pub fn install() {}
