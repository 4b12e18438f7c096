//! `floe status`: servers, volumes, recovery, rebalance, rate limits, scrub and
//! snapshot space being freed at a glance.

use crate::{recovery, Master, Reply};
use floe_protocol::{ClusterStatus, MasterResponse};

impl Master {
    pub(crate) fn status(&self) -> Reply {
        let state = self.state();
        Ok(MasterResponse::Status(Box::new(ClusterStatus {
            servers: state.servers.values().cloned().collect(),
            volumes: state.volume_list(),
            recovery: self.recovery.status(&state),
            rebalance: recovery::rebalance_status(self, &state),
            qos: state.qos_status(),
            scrub: self.integrity.status(),
            reclaim: self.reclaim.status(&state),
            gateways: self.gateways(&state),
        })))
    }
}
