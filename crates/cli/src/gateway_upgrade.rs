//! `floe gateway upgrade --pid PID`: asks a running gateway to exec its binary again
//! (SIGUSR2, see `floe_gateway::upgrade`) and waits until it runs the new image,
//! which the upgrade count in its environment shows (`exec` replaces it).

use floe_gateway::upgrade::UPGRADES_VARIABLE;
use std::time::{Duration, Instant};

pub async fn run(pid: u32, timeout: Duration) -> Result<(), String> {
    let before = upgrades(pid)?;
    let command = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<&[u8]> = command.split(|b| *b == 0).collect();
    if !words.iter().skip(1).any(|w| *w == b"gateway") {
        return Err(format!("process {pid} is not a floe gateway"));
    }
    // SAFETY: kill(2) with a signal the gateway handles; `pid` was checked above.
    if unsafe { libc::kill(pid as i32, libc::SIGUSR2) } != 0 {
        return Err(format!(
            "cannot signal process {pid}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = upgrades(pid).map_err(|e| format!("{e}: see the gateway's log"))?;
        if now > before {
            let binary = std::fs::read_link(format!("/proc/{pid}/exe"))
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "?".into());
            println!(
                "gateway {pid} runs {binary} (upgrade {now}, in {:.1}s); its clients resume as their volumes reopen",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        if started.elapsed() > timeout {
            return Err(format!(
                "gateway {pid} did not upgrade within {timeout:?}: see its log"
            ));
        }
    }
}

/// How many upgrades process `pid` went through, from its environment.
fn upgrades(pid: u32) -> Result<u64, String> {
    let environment = std::fs::read(format!("/proc/{pid}/environ"))
        .map_err(|e| format!("no process {pid} to read: {e}"))?;
    let prefix = format!("{UPGRADES_VARIABLE}=");
    Ok(environment
        .split(|b| *b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))
        .and_then(|n| std::str::from_utf8(n).ok()?.parse().ok())
        .unwrap_or(0))
}
