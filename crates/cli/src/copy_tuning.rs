//! Servers copy their large buffers with glibc's vector loop, not `rep movsb`.
//!
//! glibc's `memcpy` moves 2 KiB and more with `rep movsb`. On the AMD EPYC machines
//! Floe is measured on, that ran at 3.5 GB/s instead of 55 when the destination lay
//! 1-63 bytes past the source modulo 4 KiB (a C loop of 16 KiB copies). Headers set
//! where copies land (rustls copies each record's plaintext behind a 5-byte header),
//! so that case is common: during 1 MiB writes `memmove` took 36% of the gateway's
//! CPU. glibc reads its tunables only when a process starts, so a server
//! starts itself again with the threshold raised; the vector loop copies at full speed
//! whatever the offsets.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;

const TUNABLES: &str = "GLIBC_TUNABLES";
const THRESHOLD: &str = "glibc.cpu.x86_rep_movsb_threshold";
/// Above any copy Floe makes (glibc's maximum is u64::MAX).
const RAISED: &str = "glibc.cpu.x86_rep_movsb_threshold=4294967295";

/// Replaces this process with itself under the raised threshold, unless the threshold
/// is already set (by the first start, or by whoever started it). Call before any
/// thread starts. Other C libraries ignore the variable; so does glibc off x86.
pub fn exec_with_vector_copies() {
    let current = std::env::var_os(TUNABLES).unwrap_or_default();
    if current.to_string_lossy().contains(THRESHOLD) {
        return;
    }
    let mut tunables = current;
    if !tunables.is_empty() {
        tunables.push(":");
    }
    tunables.push(RAISED);
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| OsString::from("floe"));
    // /proc/self/exe: this very binary, even if an upgrade has replaced the file.
    let error = std::process::Command::new("/proc/self/exe")
        .arg0(arg0)
        .args(args)
        .env(TUNABLES, tunables)
        .exec();
    eprintln!("floe: cannot start again with {RAISED} ({error}); large copies may be slower");
}
