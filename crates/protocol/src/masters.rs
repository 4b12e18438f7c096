//! The master's addresses: one, or several (`a,b,c`) of which one leads and the others
//! stand by (masters on etcd). A call goes to the master believed to lead; a standby
//! answers `NotLeader`, naming the leader when it knows it, and an address that does
//! not answer is passed over, until one leads or the call's time is up. While the
//! masters elect a new leader (a few seconds after one dies) none leads: the call
//! keeps asking round them.

use crate::connection::CallError;
use crate::message::{Request, Response};
use crate::{ConnectionPool, Status};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// Pause after every master was asked and none leads.
const ROUND_PAUSE: Duration = Duration::from_millis(200);

#[derive(Debug)]
pub struct Masters {
    addresses: Vec<String>,
    /// The index of the one believed to lead.
    leader: AtomicUsize,
}

impl Masters {
    /// From `a` or `a,b,c`.
    pub fn parse(list: &str) -> Masters {
        let addresses: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(String::from)
            .collect();
        Masters {
            addresses,
            leader: AtomicUsize::new(0),
        }
    }

    /// The addresses as given (`a,b,c`).
    pub fn list(&self) -> String {
        self.addresses.join(",")
    }

    /// The one believed to lead.
    pub fn leader(&self) -> &str {
        self.addresses
            .get(self.leader.load(Ordering::Relaxed))
            .map_or("", String::as_str)
    }

    /// One call to the leading master, failing as `Closed` when none answered as
    /// leader within `limit`. With one address, a plain call.
    pub async fn call(
        &self,
        pool: &ConnectionPool,
        request: Request,
        limit: Duration,
    ) -> Result<Response, CallError> {
        let n = self.addresses.len();
        if n <= 1 {
            return match pool.call_within(self.leader(), request, limit).await {
                // As unreachable: callers that wait out a restart wait this out too.
                Err(CallError::Remote {
                    status: Status::NotLeader,
                    ..
                }) => Err(CallError::Closed(format!(
                    "{} does not lead (a standby: give every master's address, a,b,c)",
                    self.leader()
                ))),
                answered => answered,
            };
        }
        // `None`: no deadline (a scrub waits as long as it takes).
        let deadline = Instant::now().checked_add(limit);
        let left = || deadline.map_or(limit, |d| d.saturating_duration_since(Instant::now()));
        let mut at = self.leader.load(Ordering::Relaxed) % n;
        loop {
            let mut last = None;
            for _ in 0..n {
                let left = left();
                if left.is_zero() {
                    // As a transport error: callers that wait out a master restart
                    // wait out an election too.
                    let why = last.map_or_else(String::new, |e| format!(" (last: {e})"));
                    return Err(CallError::Closed(format!(
                        "no master of {} answered as leader within {limit:?}{why}",
                        self.list()
                    )));
                }
                let address = &self.addresses[at];
                match pool.call_within(address, request.clone(), left).await {
                    Err(CallError::Remote {
                        status: Status::NotLeader,
                        message,
                    }) => {
                        // Straight to the leader it names, if it is one of ours.
                        at = match self.addresses.iter().position(|a| *a == message) {
                            Some(leader) if leader != at => leader,
                            _ => (at + 1) % n,
                        };
                        last = Some(CallError::Remote {
                            status: Status::NotLeader,
                            message: format!("{address} stands by"),
                        });
                    }
                    Err(e @ (CallError::Connect { .. } | CallError::Closed(_))) => {
                        last = Some(e);
                        at = (at + 1) % n;
                    }
                    answered => {
                        self.leader.store(at, Ordering::Relaxed);
                        return answered;
                    }
                }
            }
            tokio::time::sleep(ROUND_PAUSE.min(left())).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_call_without_a_deadline_waits_instead_of_overflowing() {
        let masters = Masters::parse("127.0.0.1:1,127.0.0.1:2");
        let pool = ConnectionPool::default();
        let request = crate::Request::Master(crate::MasterRequest::Status);
        let call = masters.call(&pool, request, Duration::MAX);
        let waited = tokio::time::timeout(Duration::from_millis(300), call).await;
        assert!(waited.is_err(), "{waited:?}");
    }

    #[test]
    fn parses_a_list() {
        let masters = Masters::parse("a:1, b:2,,c:3");
        assert_eq!(masters.list(), "a:1,b:2,c:3");
        assert_eq!(masters.leader(), "a:1");
    }
}
