//! What the network sees, checked as it happens: lease grants (for the split-brain
//! check) and the changes replicas acknowledge, by chunk and version (a version must
//! never stand for two different changes).

use floe_protocol::{ChunkId, MasterRequest, MasterResponse, Request, Response};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// A lease the master granted: from `at` the volume's writes belong to `holder`.
#[derive(Debug, Clone)]
pub struct Grant {
    pub at: Duration,
    pub holder: String,
    pub generation: u32,
}

/// What one acknowledged change wrote: offset, length and a checksum of its bytes
/// (`None` for a zero).
type Change = (u64, u64, Option<u32>);

pub struct Observations {
    start: Instant,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    grants: Vec<Grant>,
    changes: BTreeMap<(ChunkId, u64), Change>,
    /// The replicas (by address) that acknowledged each change.
    acked_by: BTreeMap<(ChunkId, u64), BTreeSet<String>>,
    violations: Vec<String>,
}

impl Observations {
    pub fn new(start: Instant) -> Observations {
        Observations {
            start,
            inner: Mutex::default(),
        }
    }

    /// A request was served with `response`.
    pub fn reply(&self, request: &Request, response: &Response, server: &str) {
        let at = self.start.elapsed();
        let mut inner = self.inner.lock().unwrap();
        match (request, response) {
            (
                Request::Master(MasterRequest::AcquireLease { holder, .. }),
                Response::Master(MasterResponse::Lease { generation, .. }),
            ) => {
                // A resent request's answer: the same grant again.
                let last = inner.grants.last();
                if last.is_some_and(|g| (g.generation, &g.holder) == (*generation, holder)) {
                    return;
                }
                if let Some(last) = last.filter(|g| g.generation >= *generation) {
                    let message = format!(
                        "lease generation {generation} granted to {holder} at {at:?}, after \
                         generation {} went to {}",
                        last.generation, last.holder
                    );
                    inner.violations.push(message);
                }
                inner.grants.push(Grant {
                    at,
                    holder: holder.clone(),
                    generation: *generation,
                })
            }
            (
                Request::Write {
                    chunk,
                    stamp,
                    offset,
                    data,
                    ..
                },
                Response::Done,
            ) => inner.change(
                *chunk,
                stamp.version,
                (*offset, data.len() as u64, Some(crc32c::crc32c(data))),
                server,
            ),
            (
                Request::Zero {
                    chunk,
                    stamp,
                    offset,
                    length,
                    ..
                },
                Response::Done,
            ) => inner.change(*chunk, stamp.version, (*offset, *length, None), server),
            _ => {}
        }
    }

    pub fn grants(&self) -> Vec<Grant> {
        self.inner.lock().unwrap().grants.clone()
    }

    /// The newest version of `chunk` that at least `majority` replicas acknowledged:
    /// committed, so every replica of a healed chunk must hold it.
    /// Returns the version and the replicas that acknowledged it.
    pub fn committed(&self, chunk: ChunkId, majority: usize) -> (u64, Vec<String>) {
        let inner = self.inner.lock().unwrap();
        inner
            .acked_by
            .range((chunk, 0)..=(chunk, u64::MAX))
            .rev()
            .find(|(_, servers)| servers.len() >= majority)
            .map(|((_, version), servers)| (*version, servers.iter().cloned().collect()))
            .unwrap_or_default()
    }

    /// The holder of the latest grant.
    pub fn holder(&self) -> Option<String> {
        let inner = self.inner.lock().unwrap();
        inner.grants.last().map(|g| g.holder.clone())
    }

    pub fn violation(&self, what: String) {
        self.inner.lock().unwrap().violations.push(what);
    }

    pub fn violations(&self) -> Vec<String> {
        self.inner.lock().unwrap().violations.clone()
    }
}

impl Inner {
    fn change(&mut self, chunk: ChunkId, version: u64, change: Change, server: &str) {
        self.acked_by
            .entry((chunk, version))
            .or_default()
            .insert(server.to_string());
        let known = *self.changes.entry((chunk, version)).or_insert(change);
        if known != change {
            self.violations.push(format!(
                "chunk {chunk:?} version {version:#x} acknowledged for two different changes: \
                 {known:?} and {change:?}"
            ));
        }
    }
}
