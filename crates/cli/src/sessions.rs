//! Volume sessions and the gateways serving them: `floe volume move-session VOLUME
//! --to GATEWAY` (the master records the move and the two gateways carry it out, see
//! `floe_gateway`; this follows it, printing each step, until the target holds the
//! volume's lease), the gateways in `floe status`, the holder in `volume info`.

use crate::views;
use floe_client::master::MasterClient;
use floe_protocol::{ClusterStatus, MasterRequest, MasterResponse, SessionInfo};
use serde::Serialize;
use std::time::{Duration, Instant};

/// The outcome, for `--json`.
#[derive(Serialize)]
struct Moved {
    volume: String,
    from: String,
    to: String,
    /// The target's lease generation.
    generation: u32,
    /// From the request until the holder released the lease, and until the target
    /// held it.
    released_ms: Option<u64>,
    moved_ms: u64,
}

fn session(reply: MasterResponse) -> Result<SessionInfo, String> {
    match reply {
        MasterResponse::Session(session) => Ok(session),
        other => Err(format!("unexpected reply from the master: {other:?}")),
    }
}

pub async fn move_session(
    master: &MasterClient,
    name: &str,
    to: &str,
    timeout: Duration,
    format: views::Format,
) -> Result<(), String> {
    let started = Instant::now();
    let request = MasterRequest::MoveSession {
        name: name.to_string(),
        to: to.to_string(),
    };
    let reply = master.call(request).await;
    let mut now = session(reply.map_err(|e| format!("cannot move volume {name}: {e}"))?)?;
    let from = now.gateway.clone().unwrap_or_default();
    let say = |line: String| {
        if !format.json {
            println!("{line}");
        }
    };
    let mut released_ms = None;
    if now.gateway.as_deref() != Some(to) {
        say(format!(
            "moving volume {name} from gateway {from} to gateway {to}"
        ));
    }
    while now.gateway.as_deref() != Some(to) {
        if started.elapsed() > timeout {
            return Err(format!(
                "volume {name} has not reached gateway {to} after {timeout:?} (held by {})",
                now.holder.as_deref().unwrap_or("nobody")
            ));
        }
        let watch = MasterRequest::WatchSession {
            name: name.to_string(),
            known: Some(now.clone()),
            wait_ms: 2000,
        };
        now = session(master.call(watch).await.map_err(|e| e.to_string())?)?;
        if now.holder.is_none() && released_ms.is_none() {
            let ms = started.elapsed().as_millis() as u64;
            released_ms = Some(ms);
            say(format!(
                "gateway {from} answered its clients, flushed and released the volume ({ms} ms)"
            ));
        }
        if now.moving.is_none() && now.gateway.as_deref() != Some(to) {
            return Err(format!(
                "the move of volume {name} ended before gateway {to} took it (held by {}): is {to} still up? (`floe status` lists the gateways)",
                now.holder.as_deref().unwrap_or("nobody")
            ));
        }
    }
    let moved_ms = started.elapsed().as_millis() as u64;
    if format.json {
        return views::print(&Moved {
            volume: name.to_string(),
            from,
            to: to.to_string(),
            generation: now.generation,
            released_ms,
            moved_ms,
        });
    }
    println!(
        "gateway {to} holds volume {name} (lease generation {}, {moved_ms} ms): its clients reconnect there",
        now.generation
    );
    Ok(())
}

/// Who serves volume `name` now, for `floe volume info`.
pub async fn served_by(master: &MasterClient, name: &str) -> Result<SessionInfo, String> {
    let watch = MasterRequest::WatchSession {
        name: name.to_string(),
        known: None,
        wait_ms: 0,
    };
    session(master.call(watch).await.map_err(|e| e.to_string())?)
}

/// The gateways the master hears from, for `floe status`.
pub fn print_gateways(status: &ClusterStatus) {
    for g in &status.gateways {
        let seen = g.seen_ms_ago as f64 / 1000.0;
        let gone = if g.seen_ms_ago > floe_master::GATEWAY_GONE.as_millis() as u64 {
            " (gone)"
        } else {
            ""
        };
        println!(
            "gateway {} at {}: seen {seen:.1} s ago{gone}, holds {}",
            g.name,
            g.address,
            if g.volumes.is_empty() {
                "no volume".to_string()
            } else {
                g.volumes.join(", ")
            }
        );
    }
}
