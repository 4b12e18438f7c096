//! Small helpers shared by the fio, ext4, etcd and bad-input tests.

use crate::cluster::{ok, output, Cluster};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Runs qemu-io `commands` (one connection) on `uri`; panics if any command fails or a
/// pattern does not match (qemu-io then exits non-zero or prints the failure).
pub fn qemu_io(uri: &str, commands: &[&str]) -> String {
    let mut command = Command::new("qemu-io");
    command.args(["-f", "raw"]);
    for c in commands {
        command.args(["-c", c]);
    }
    command.arg(uri);
    let out = ok(&mut command);
    assert!(
        !out.contains("Pattern verification failed") && !out.contains("failed"),
        "qemu-io {commands:?}:\n{out}"
    );
    out
}

/// `floe --master M ARGS`, for commands that are expected to fail.
pub fn floe_output(cluster: &Cluster, args: &[&str]) -> Output {
    output(cluster.command_as("admin").args(args))
}

/// Combined stdout and stderr, for messages.
pub fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => {
            !matches!(stat.rsplit(')').next().map(str::trim_start), Some(s) if s.starts_with('Z') || s.starts_with('X'))
        }
        Err(_) => false,
    }
}

/// Waits until `path`'s contents satisfy `check` (logs are written asynchronously).
pub fn wait_for_file(path: &Path, timeout: Duration, check: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let contents = std::fs::read_to_string(path).unwrap_or_default();
        if check(&contents) || Instant::now() > deadline {
            return contents;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until `done` holds, or fails after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < timeout, "{what}: not after {timeout:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// kill -9 of a cluster process this test started (itself or through the demo).
pub fn kill9(pid: u32) {
    // SAFETY: kill(2) on a PID the test started and has not reaped.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill -9 {pid}: {}", std::io::Error::last_os_error());
}
