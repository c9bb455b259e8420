//! Scratch space for the packages a test binary writes: one directory per process under the
//! system temp dir, removed when the binary exits (an `atexit` hook), so test runs do not pile up
//! synthetic packages in /tmp. A binary killed by a signal still leaves its directory behind.

use std::path::PathBuf;
use std::sync::OnceLock;

static ROOT: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_root() {
    if let Some(root) = ROOT.get() {
        // Best effort at exit: nothing useful can be done about a failure here.
        let _ = std::fs::remove_dir_all(root);
    }
}

/// `<temp>/xdna_<prefix>_<pid>/<name>` (not created). The first call fixes the prefix, creates the
/// per-process directory and registers its removal at exit.
pub fn scratch_path(prefix: &str, name: &str) -> PathBuf {
    let root = ROOT.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("xdna_{prefix}_{}", std::process::id()));
        std::fs::create_dir_all(&root).expect("create the test scratch directory");
        // SAFETY: `remove_root` is a plain `extern "C" fn()` with no captured state; it only
        // reads the `OnceLock`, which is set before registration.
        let registered = unsafe { libc::atexit(remove_root) };
        assert_eq!(
            registered, 0,
            "atexit refused the scratch-directory cleanup"
        );
        root
    });
    root.join(name)
}
