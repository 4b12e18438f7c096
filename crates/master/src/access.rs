//! Which peer may ask the master what, by its certificate's role (with TLS): an
//! operator changes volumes and the cluster, a gateway writes volumes, a chunk server
//! reports in; any process of the cluster may look; an NBD client asks nothing.

use floe_protocol::tls::Role;
use floe_protocol::{MasterRequest, Request};

/// `Err` says why a peer of `role` may not ask `request`.
pub(crate) fn permits(role: Role, request: &Request) -> Result<(), String> {
    use MasterRequest as R;
    use Role::*;
    let Request::Master(request) = request else {
        // Answered as a request the master does not serve.
        return Ok(());
    };
    let allowed: &[Role] = match request {
        R::ListVolumes
        | R::GetVolumeMap { .. }
        | R::GetClusterMap
        | R::Status
        | R::WatchSession { .. } => &Role::CLUSTER,
        R::GatewayPoll { .. } => &[Gateway],
        R::Register(_) | R::Heartbeat { .. } => &[Chunkserver],
        R::AcquireLease { .. }
        | R::RenewLease { .. }
        | R::ReleaseLease { .. }
        | R::AllocateChunk { .. }
        | R::ReportLaggard { .. }
        | R::WatchSnapshotEpochs { .. }
        | R::ConfirmSnapshotEpoch { .. } => &[Gateway, Admin],
        R::CreateVolume(_)
        | R::ResizeVolume { .. }
        | R::DeleteVolume { .. }
        | R::SetWriteMode { .. }
        | R::SetQos { .. }
        | R::ExpandCluster { .. }
        | R::RemapPg { .. }
        | R::ShrinkLayer { .. }
        | R::MergeLayers { .. }
        | R::MarkLost { .. }
        | R::Scrub { .. }
        | R::CreateSnapshot { .. }
        | R::DeleteSnapshot { .. }
        | R::CloneVolume { .. }
        | R::FlattenVolume { .. }
        | R::MoveSession { .. } => &[Admin],
    };
    if allowed.contains(&role) {
        return Ok(());
    }
    let roles: Vec<&str> = allowed.iter().map(|r| r.name()).collect();
    // The variant's name, as its Debug form starts.
    let debug = format!("{request:?}");
    let what = debug.split(|c: char| !c.is_alphanumeric()).next();
    Err(format!(
        "{} needs a certificate of role {}; this one's role is {role}",
        what.unwrap_or_default(),
        roles.join(" or ")
    ))
}
