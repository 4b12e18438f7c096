//! Placement: which chunk servers hold the replicas of a chunk.
//!
//! - [`place`]: what the master uses today (below).
//! - [`crush`]: Ceph's CRUSH, bit-exact with `crushtool`, with its text map syntax.
//! - [`mapx`]: MAPX's time layers on top of CRUSH: expansion without migration, and
//!   remap, shrink and merge for the migration that is wanted.
//! - [`simulate`]: the MAPX paper's experiments (PGs moved by expansions and merges).
//!
//! Everything goes through [`place`], the one function a later issue replaces with
//! CRUSH straw2 + MAPX layers. Today it is weighted rendezvous hashing (the same idea
//! as straw2: each candidate draws a hash-derived straw scaled by its weight, the
//! longest wins), which keeps placement deterministic and proportional to capacity,
//! with two rules: replicas on distinct hosts, and an `ssd` primary when one exists.

pub mod crush;
pub mod mapx;
pub mod simulate;

use floe_protocol::{ChunkId, DeviceClass, ServerId, ServerInfo};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("{replicas} replicas need {replicas} distinct hosts with a live chunk server, but only {hosts} are available: start chunk servers on more hosts or lower the replica count")]
    NotEnoughHosts { replicas: usize, hosts: usize },
}

/// Picks `replicas` servers among `candidates` (only live ones should be passed) for
/// `chunk`; the first is the primary.
pub fn place(
    chunk: ChunkId,
    candidates: &[ServerInfo],
    replicas: usize,
) -> Result<Vec<ServerId>, PlacementError> {
    let mut ranked: Vec<(f64, &ServerInfo)> = candidates
        .iter()
        .filter(|s| s.capacity_bytes > 0)
        .map(|s| (straw(chunk, s), s))
        .collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut hosts: Vec<&str> = ranked.iter().map(|(_, s)| s.host.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    if hosts.len() < replicas {
        return Err(PlacementError::NotEnoughHosts {
            replicas,
            hosts: hosts.len(),
        });
    }
    let primary = ranked
        .iter()
        .find(|(_, s)| s.class == DeviceClass::Ssd)
        .unwrap_or(&ranked[0])
        .1;
    let mut chosen = vec![primary];
    for (_, server) in &ranked {
        if chosen.len() == replicas {
            break;
        }
        if chosen.iter().all(|c| c.host != server.host) {
            chosen.push(server);
        }
    }
    Ok(chosen.iter().map(|s| s.id).collect())
}

/// ln(u) / weight for a hash-uniform u in (0, 1]: larger is better, and the chance
/// of winning is proportional to weight.
fn straw(chunk: ChunkId, server: &ServerInfo) -> f64 {
    let h = mix(chunk.volume_id ^ mix(chunk.index ^ mix(server.id as u64)));
    let u = ((h >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    u.ln() / (server.capacity_bytes as f64)
}

/// splitmix64's finaliser: a cheap, well-distributed 64-bit mix.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(id: ServerId, host: &str, class: DeviceClass) -> ServerInfo {
        ServerInfo {
            id,
            uuid: format!("u{id}"),
            address: String::new(),
            host: host.into(),
            class,
            emulated: false,
            capacity_bytes: 1 << 30,
            used_bytes: 0,
            up: true,
            lost: false,
        }
    }

    fn cluster() -> Vec<ServerInfo> {
        use DeviceClass::*;
        vec![
            server(1, "h1", Ssd),
            server(2, "h1", Hdd),
            server(3, "h2", Ssd),
            server(4, "h2", Hdd),
            server(5, "h3", Hdd),
            server(6, "h3", Hdd),
        ]
    }

    #[test]
    fn distinct_hosts_ssd_primary_and_spread() {
        let servers = cluster();
        let mut primaries = [0u32; 7];
        let mut replicas_per_server = [0u32; 7];
        for index in 0..3000 {
            let chunk = ChunkId {
                volume_id: 1,
                index,
            };
            let picked = place(chunk, &servers, 3).unwrap();
            assert_eq!(picked, place(chunk, &servers, 3).unwrap(), "deterministic");
            let mut hosts: Vec<_> = picked
                .iter()
                .map(|id| &servers[*id as usize - 1].host)
                .collect();
            hosts.sort();
            hosts.dedup();
            assert_eq!(hosts.len(), 3, "replicas on distinct hosts: {picked:?}");
            assert_eq!(servers[picked[0] as usize - 1].class, DeviceClass::Ssd);
            primaries[picked[0] as usize] += 1;
            for id in picked {
                replicas_per_server[id as usize] += 1;
            }
        }
        assert!(primaries[1] > 1000 && primaries[3] > 1000, "{primaries:?}");
        assert!(
            replicas_per_server[1..].iter().all(|&n| n > 600),
            "{replicas_per_server:?}"
        );
    }

    #[test]
    fn too_few_hosts_is_a_clear_error() {
        let servers = &cluster()[..4];
        let chunk = ChunkId {
            volume_id: 1,
            index: 0,
        };
        assert_eq!(
            place(chunk, servers, 3),
            Err(PlacementError::NotEnoughHosts {
                replicas: 3,
                hosts: 2
            })
        );
    }
}
