//! Volume rate limits (URSA section 3.2: a client that writes too fast is slowed by the
//! master before the SSD journals of one machine run out of quota).
//!
//! A volume's writer enforces [`VolumeLimits`], handed out with every lease grant and
//! renewal: the operator's limits on all I/O (`floe volume set-qos`), and on writes the
//! lower of those and a pressure limit. The pressure limit comes from the fullest
//! journal among the chunk servers holding the volume's chunks, as they report it in
//! their heartbeats: none up to [`PRESSURE_START`] of the quota, then the volume's
//! write rate scaled down linearly to [`PRESSURE_FLOOR`] of it at a full journal.

use crate::state::State;
use crate::{Master, Reply};
use floe_protocol::{
    JournalUsage, MasterResponse, QosLimits, QosStatus, ServerId, Status, Throttled, Volume,
    VolumeLimits,
};
use std::collections::BTreeSet;

/// Journal fill (used / quota) above which the volumes on it are throttled.
pub const PRESSURE_START: f64 = 0.8;
/// The smallest fraction of its rate a throttled volume keeps, so its writes still
/// progress while replay drains the journal.
pub const PRESSURE_FLOOR: f64 = 0.05;
/// What the writes of a volume without operator limits are scaled from under pressure:
/// roughly what one SSD journal absorbs, so the first step already slows a volume that
/// outruns replay.
pub const PRESSURE_BASE: QosLimits = QosLimits {
    iops: 5000,
    bytes_per_second: 200 << 20,
};

fn fill(journal: JournalUsage) -> f64 {
    journal.used_bytes as f64 / journal.quota_bytes as f64
}

/// The fraction of its write rate a volume keeps while the fullest journal holding its
/// chunks is at `journal`; `None`: not throttled (no journal, or at most
/// [`PRESSURE_START`] full).
pub fn pressure_fraction(journal: JournalUsage) -> Option<f64> {
    if journal.quota_bytes == 0 || fill(journal) <= PRESSURE_START {
        return None;
    }
    let over = ((fill(journal) - PRESSURE_START) / (1.0 - PRESSURE_START)).min(1.0);
    Some(PRESSURE_FLOOR + (1.0 - PRESSURE_FLOOR) * (1.0 - over))
}

/// Write limits at `fraction` of the operator's limits (of [`PRESSURE_BASE`] where the
/// operator set none), so never above the operator's; at least 1 so nothing reads as
/// "unlimited".
pub fn pressure_limits(operator: QosLimits, fraction: f64) -> QosLimits {
    let scale = |limit: u64, base: u64| {
        let from = if limit == 0 { base } else { limit };
        ((from as f64 * fraction) as u64).max(1)
    };
    QosLimits {
        iops: scale(operator.iops, PRESSURE_BASE.iops),
        bytes_per_second: scale(operator.bytes_per_second, PRESSURE_BASE.bytes_per_second),
    }
}

impl State {
    /// What `volume`'s writer enforces, and why its writes are throttled if they are.
    pub(crate) fn limits(&self, volume: &Volume) -> (VolumeLimits, Option<String>) {
        let unthrottled = VolumeLimits {
            all: volume.qos,
            writes: volume.qos,
        };
        // Most of the time no journal is under pressure: skip the walk over the chunks.
        let pressured: Vec<(ServerId, JournalUsage)> = self
            .journals
            .iter()
            .filter(|(id, journal)| {
                self.servers.get(id).is_some_and(|s| s.up) && pressure_fraction(**journal).is_some()
            })
            .map(|(id, journal)| (*id, *journal))
            .collect();
        if pressured.is_empty() {
            return (unthrottled, None);
        }
        let holders: BTreeSet<ServerId> = self
            .chunks
            .get(&volume.id)
            .into_iter()
            .flat_map(|chunks| chunks.values())
            .flat_map(|placement| placement.replicas.iter().copied())
            .collect();
        let Some((id, journal)) = pressured
            .into_iter()
            .filter(|(id, _)| holders.contains(id))
            .max_by(|a, b| fill(a.1).total_cmp(&fill(b.1)))
        else {
            return (unthrottled, None);
        };
        let fraction = pressure_fraction(journal).expect("filtered on pressure");
        let limits = VolumeLimits {
            all: volume.qos,
            writes: pressure_limits(volume.qos, fraction),
        };
        let reason = format!(
            "the journal of chunk server {id} is {:.0}% full (writes at {:.0}%)",
            fill(journal) * 100.0,
            fraction * 100.0
        );
        (limits, Some(reason))
    }

    pub(crate) fn qos_status(&self) -> QosStatus {
        QosStatus {
            journals: self
                .journals
                .iter()
                .filter(|(_, journal)| journal.quota_bytes > 0)
                .map(|(id, journal)| (*id, *journal))
                .collect(),
            throttled: self
                .volumes
                .values()
                .filter_map(|volume| {
                    let (limits, reason) = self.limits(volume);
                    Some(Throttled {
                        volume: volume.spec.name.clone(),
                        writes: limits.writes,
                        reason: reason?,
                    })
                })
                .collect(),
        }
    }
}

impl Master {
    /// `floe volume set-qos`: the writer picks the change up at its next lease renewal.
    pub(crate) async fn set_qos(
        &self,
        name: &str,
        iops: Option<u64>,
        bytes_per_second: Option<u64>,
    ) -> Reply {
        if iops.is_none() && bytes_per_second.is_none() {
            return Err((
                Status::BadRequest,
                "no limit given: set an IOPS or a bandwidth limit".into(),
            ));
        }
        let volume = self
            .put_volume(|state| {
                let mut volume = state.volume(name)?;
                volume.qos.iops = iops.unwrap_or(volume.qos.iops);
                volume.qos.bytes_per_second =
                    bytes_per_second.unwrap_or(volume.qos.bytes_per_second);
                Ok(volume)
            })
            .await?;
        tracing::info!(
            volume = name,
            iops = volume.qos.iops,
            bytes_per_second = volume.qos.bytes_per_second,
            "rate limits set"
        );
        Ok(MasterResponse::Volume(volume))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn journal(percent: u64) -> JournalUsage {
        JournalUsage {
            used_bytes: percent << 20,
            quota_bytes: 100 << 20,
        }
    }

    #[test]
    fn pressure_starts_at_80_percent_and_falls_to_the_floor() {
        assert_eq!(
            pressure_fraction(JournalUsage::default()),
            None,
            "no journal"
        );
        assert_eq!(pressure_fraction(journal(50)), None);
        assert_eq!(pressure_fraction(journal(80)), None);
        let at = |percent| pressure_fraction(journal(percent)).unwrap();
        assert!(
            (at(90) - (1.0 + PRESSURE_FLOOR) / 2.0).abs() < 1e-9,
            "halfway"
        );
        assert!(at(85) > at(90) && at(90) > at(95), "monotonic");
        assert_eq!(at(100), PRESSURE_FLOOR);
        assert_eq!(
            at(130),
            PRESSURE_FLOOR,
            "over quota (overflow) stays at the floor"
        );
    }

    /// Metadata and peers from before rate limits still parse.
    #[test]
    fn older_volumes_heartbeats_and_lease_replies_parse() {
        let volume: Volume = serde_json::from_str(
            r#"{"id":1,"name":"v","size_bytes":4096,"replicas":3,"chunk_bytes":65536,"stripe_unit_bytes":4096,"stripe_count":4}"#,
        )
        .unwrap();
        assert!(volume.qos.is_unlimited());
        let heartbeat: floe_protocol::MasterRequest =
            serde_json::from_str(r#"{"op":"heartbeat","id":3,"used_bytes":7}"#).unwrap();
        assert!(matches!(
            heartbeat,
            floe_protocol::MasterRequest::Heartbeat {
                journal_quota_bytes: 0,
                ..
            }
        ));
        let lease: MasterResponse =
            serde_json::from_str(r#"{"op":"lease","generation":2,"term_ms":5000}"#).unwrap();
        assert!(
            matches!(lease, MasterResponse::Lease { limits, .. } if limits == VolumeLimits::default())
        );
    }

    #[test]
    fn pressure_limits_never_exceed_the_operators() {
        let operator = QosLimits {
            iops: 300,
            bytes_per_second: 0,
        };
        let limits = pressure_limits(operator, 0.5);
        assert_eq!(limits.iops, 150);
        assert_eq!(limits.bytes_per_second, PRESSURE_BASE.bytes_per_second / 2);
        let floor = pressure_limits(
            QosLimits {
                iops: 10,
                bytes_per_second: 10,
            },
            PRESSURE_FLOOR,
        );
        assert_eq!(
            (floor.iops, floor.bytes_per_second),
            (1, 1),
            "never 0 (unlimited)"
        );
    }
}
