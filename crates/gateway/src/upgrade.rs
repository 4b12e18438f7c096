//! Upgrading a running gateway in place (URSA section 5.2): on SIGUSR2 (`floe gateway
//! upgrade`) the gateway parks its NBD connections at request boundaries (see
//! `floe_nbd::handover`), closes its volumes (acknowledged writes retired, leases
//! released), and execs the gateway binary found at its own path again, which is the
//! new one if it was replaced. The process keeps its PID, its listening socket and its
//! plain connections; the new image reopens the volumes and serves on. A client sees
//! a pause, not a disconnect (TLS clients are disconnected: see `floe_nbd::handover`).
//!
//! The state crosses `exec` in a memfd named by `FLOE_GATEWAY_HANDOVER`; the
//! descriptors it names are kept open across `exec` (close-on-exec cleared).

use floe_nbd::{Handover, Parked};
use serde::{Deserialize, Serialize};
use std::ffi::CString;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Names the memfd holding the state, in the new image's environment.
const HANDOVER_VARIABLE: &str = "FLOE_GATEWAY_HANDOVER";
/// How many upgrades this process went through (`floe gateway upgrade` watches it).
pub const UPGRADES_VARIABLE: &str = "FLOE_GATEWAY_UPGRADES";

/// The state as the new image reads it.
#[derive(Deserialize)]
struct State {
    listener: RawFd,
    connections: Vec<Parked>,
}

/// The state as the old image writes it (parked connections are not `Clone`).
#[derive(Serialize)]
struct StateRef<'a> {
    listener: RawFd,
    connections: &'a [Parked],
}

/// The binary this process started from, by path: read before anyone replaces it,
/// since `/proc/self/exe` then names the old, deleted file.
static EXECUTABLE: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// Remembers where this process's binary is; call at start.
pub fn remember_executable() {
    EXECUTABLE.get_or_init(|| std::env::current_exe().map_err(|e| e.to_string()));
}

/// What the previous image of this process handed over, if it did: the listening
/// socket and the parked connections. Call once, before anything opens files.
pub fn inherited() -> Result<Option<(std::net::TcpListener, Vec<Parked>)>, String> {
    // Left in the environment: the gateway starts no children, and the next upgrade
    // names its own memfd.
    let Some(fd) = std::env::var_os(HANDOVER_VARIABLE) else {
        return Ok(None);
    };
    let fd: RawFd = fd
        .to_str()
        .and_then(|fd| fd.parse().ok())
        .ok_or_else(|| format!("{HANDOVER_VARIABLE} names no descriptor"))?;
    // SAFETY: the previous image wrote the state to this memfd and named it here for
    // this image alone; nothing else owns it.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut json = String::new();
    file.read_to_string(&mut json)
        .map_err(|e| format!("cannot read the handed-over state: {e}"))?;
    let state: State = serde_json::from_str(&json)
        .map_err(|e| format!("the handed-over state does not parse: {e}"))?;
    // SAFETY: the listening socket the previous image kept open for this one.
    let listener = unsafe { std::net::TcpListener::from_raw_fd(state.listener) };
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("the handed-over listener: {e}"))?;
    tracing::info!(
        connections = state.connections.len(),
        upgrades = upgrades(),
        "resuming after an upgrade"
    );
    Ok(Some((listener, state.connections)))
}

/// How many times this process was upgraded.
fn upgrades() -> u64 {
    std::env::var(UPGRADES_VARIABLE)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Execs this gateway's binary again with `handover`; returns only if that failed,
/// saying why (the caller serves on with the same handover).
pub fn exec(handover: &Handover) -> String {
    match try_exec(handover) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

fn try_exec(handover: &Handover) -> Result<std::convert::Infallible, String> {
    let executable = EXECUTABLE
        .get()
        .ok_or("the gateway's binary was not remembered at start")?
        .clone()?;
    let listener = handover.listener.as_raw_fd();
    let json = serde_json::to_string(&StateRef {
        listener,
        connections: &handover.connections,
    })
    .map_err(|e| e.to_string())?;
    // SAFETY: memfd_create with a valid name; the descriptor is checked below.
    let fd = unsafe { libc::memfd_create(c"floe-gateway-handover".as_ptr(), 0) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a descriptor just made, owned here; kept open for the new image (no
    // close-on-exec), so it is leaked on purpose below.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(json.as_bytes())
        .and_then(|()| file.rewind())
        .map_err(|e| format!("cannot write the handed-over state: {e}"))?;
    std::mem::forget(file);
    for fd in handover
        .connections
        .iter()
        .map(Parked::fd)
        .chain([listener])
    {
        keep_across_exec(fd)?;
    }
    let c_string = |bytes: &[u8]| CString::new(bytes).map_err(|e| e.to_string());
    let arguments: Vec<CString> = std::env::args_os()
        .map(|a| c_string(a.as_bytes()))
        .collect::<Result<_, _>>()?;
    // The environment is built here, not changed with set_var: other threads of
    // this process may be reading it.
    let mut environment: Vec<CString> = std::env::vars_os()
        .filter(|(name, _)| name != HANDOVER_VARIABLE && name != UPGRADES_VARIABLE)
        .map(|(name, value)| c_string(&[name.as_bytes(), b"=", value.as_bytes()].concat()))
        .collect::<Result<_, _>>()?;
    environment.push(c_string(format!("{HANDOVER_VARIABLE}={fd}").as_bytes())?);
    environment.push(c_string(
        format!("{UPGRADES_VARIABLE}={}", upgrades() + 1).as_bytes(),
    )?);
    let program = c_string(executable.as_os_str().as_bytes())?;
    tracing::info!(
        binary = %executable.display(),
        connections = handover.connections.len(),
        "upgrading: exec"
    );
    let pointers = |strings: &[CString]| -> Vec<*const libc::c_char> {
        let mut out: Vec<_> = strings.iter().map(|s| s.as_ptr()).collect();
        out.push(std::ptr::null());
        out
    };
    let (argv, envp) = (pointers(&arguments), pointers(&environment));
    // SAFETY: the program, argv and envp are NUL-terminated C strings that outlive
    // the call, and argv and envp end with a null pointer; on success nothing here
    // runs on.
    unsafe { libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    let error = std::io::Error::last_os_error();
    // SAFETY: the memfd made above, no longer needed.
    unsafe { libc::close(fd) };
    Err(format!("exec {}: {error}", executable.display()))
}

fn keep_across_exec(fd: RawFd) -> Result<(), String> {
    // SAFETY: fcntl on a descriptor this process holds open; only its flags change.
    let cleared = unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    if cleared < 0 {
        return Err(format!(
            "cannot keep descriptor {fd} across exec: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}
