//! Several masters on one etcd store (issue 15): each listens at once, campaigns in the
//! store's election, and stands by until it leads, answering every request
//! `NotLeader` with the leader's address (clients follow it, see
//! `floe_protocol::masters`). Once elected it loads the cluster state from the store,
//! as a restarted master does (leases get a whole term, audits are queued), and
//! serves. It stops (the process exits) as soon as it may no longer lead: its etcd
//! lease went unrenewed, or the store refused a batch because another leads.

use crate::Master;
use floe_metadata::Election;
use floe_protocol::server::Handler;
use floe_protocol::tls::Role;
use floe_protocol::{Request, Response, Status};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::time::Instant;

/// How long a standby keeps the leader's address before asking the store again.
const LEADER_FRESH: Duration = Duration::from_millis(500);

/// The master's request handler: a standby's until it leads, then the master's.
pub(crate) struct Gate {
    master: OnceLock<Arc<Master>>,
    election: Option<Arc<dyn Election>>,
    leader: Mutex<Option<(Instant, String)>>,
}

impl Gate {
    pub(crate) fn new(election: Option<Arc<dyn Election>>) -> Gate {
        Gate {
            master: OnceLock::new(),
            election,
            leader: Mutex::new(None),
        }
    }

    /// From now on requests go to `master`.
    pub(crate) fn lead(&self, master: Arc<Master>) {
        assert!(self.master.set(master).is_ok(), "a master leads once");
    }

    /// The leader's address as the election last showed it ("" when none leads).
    async fn leader(&self) -> String {
        if let Some((at, leader)) = &*self.leader.lock().unwrap() {
            if at.elapsed() < LEADER_FRESH {
                return leader.clone();
            }
        }
        let leader = match &self.election {
            Some(election) => election.leader().await.unwrap_or_default(),
            None => String::new(),
        };
        *self.leader.lock().unwrap() = Some((Instant::now(), leader.clone()));
        leader
    }
}

impl Handler for Gate {
    fn permits(&self, role: Role, request: &Request) -> Result<(), String> {
        crate::access::permits(role, request)
    }

    async fn handle(self: Arc<Self>, request: Request) -> Response {
        match self.master.get() {
            Some(master) => master.clone().handle(request).await,
            None => Response::error(Status::NotLeader, self.leader().await),
        }
    }
}
