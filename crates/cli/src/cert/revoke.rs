//! `floe cert revoke`: the CA's revocation list, `DIR/crl.pem`. Every process looks
//! for it beside its `--ca` file and reads it again when it changes
//! (`floe_protocol::tls`), so copying the new list to a host is all a revocation
//! takes there.

use super::{issuer, CA_DAYS};
use floe_protocol::tls::CRL_FILE;
use rcgen::{CertificateRevocationListParams, KeyIdMethod, RevokedCertParams, SerialNumber};
use std::path::Path;
use time::{Duration, OffsetDateTime};
use x509_parser::pem::parse_x509_pem;

/// Adds `DIR/NAME.pem`'s certificate to `DIR/crl.pem` and signs the list again.
pub fn revoke(dir: &Path, name: &str) -> Result<(), String> {
    let holder = dir.join(format!("{name}.pem"));
    let pem = std::fs::read(&holder)
        .map_err(|e| format!("cannot read {}: {e} (no such holder?)", holder.display()))?;
    let serial = serial_of(&pem).map_err(|e| format!("{}: {e}", holder.display()))?;
    let list = dir.join(CRL_FILE);
    let mut revoked = match std::fs::read(&list) {
        Ok(pem) => revoked_in(&pem).map_err(|e| format!("{}: {e}", list.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(format!("cannot read {}: {e}", list.display())),
    };
    if revoked.iter().any(|r| r.serial_number == serial) {
        return Err(format!("{name}'s certificate is revoked already"));
    }
    let now = OffsetDateTime::now_utc();
    revoked.push(RevokedCertParams {
        serial_number: serial.clone(),
        revocation_time: now,
        reason_code: None,
        invalidity_date: None,
    });
    let params = CertificateRevocationListParams {
        this_update: now,
        // Floe does not enforce it: a list stays in force until replaced.
        next_update: now + Duration::days(CA_DAYS),
        // Each list supersedes the one before: milliseconds since the epoch increase.
        crl_number: SerialNumber::from((now.unix_timestamp_nanos() / 1_000_000) as u64),
        issuing_distribution_point: None,
        revoked_certs: revoked,
        key_identifier_method: KeyIdMethod::Sha256,
    };
    let signed = params
        .signed_by(&issuer(dir)?)
        .and_then(|crl| crl.pem())
        .map_err(|e| format!("cannot sign the revocation list: {e}"))?;
    // A rename, so a process never reads half a list.
    let fresh = dir.join(format!("{CRL_FILE}.new"));
    std::fs::write(&fresh, signed)
        .and_then(|()| std::fs::rename(&fresh, &list))
        .map_err(|e| format!("cannot write {}: {e}", list.display()))?;
    println!(
        "revoked {name} (serial {serial}); {} now lists it: copy it beside ca.pem on every \
         host, and each process refuses {name} from its next connection on (open ones stay)",
        list.display()
    );
    Ok(())
}

fn serial_of(pem: &[u8]) -> Result<SerialNumber, String> {
    let (_, pem) = parse_x509_pem(pem).map_err(|e| format!("not a PEM file: {e}"))?;
    let certificate = pem
        .parse_x509()
        .map_err(|e| format!("not a certificate: {e}"))?;
    Ok(SerialNumber::from_slice(certificate.raw_serial()))
}

/// The entries of an existing list, to carry into the next one.
fn revoked_in(pem: &[u8]) -> Result<Vec<RevokedCertParams>, String> {
    let (_, pem) = parse_x509_pem(pem).map_err(|e| format!("not a PEM file: {e}"))?;
    let (_, list) = x509_parser::parse_x509_crl(&pem.contents)
        .map_err(|e| format!("not a revocation list: {e}"))?;
    list.iter_revoked_certificates()
        .map(|entry| {
            let revocation_time =
                OffsetDateTime::from_unix_timestamp(entry.revocation_date.timestamp())
                    .map_err(|e| format!("a revocation date: {e}"))?;
            Ok(RevokedCertParams {
                serial_number: SerialNumber::from_slice(entry.raw_serial()),
                revocation_time,
                reason_code: None,
                invalidity_date: None,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revocation_list_keeps_its_earlier_entries_and_refuses_a_second_revocation() {
        let dir = tempfile::tempdir().unwrap();
        super::super::init(dir.path()).unwrap();
        for name in ["alice", "bob"] {
            super::super::issue(
                dir.path(),
                name,
                floe_protocol::tls::Role::Client,
                &["localhost".into()],
                1,
            )
            .unwrap();
        }
        revoke(dir.path(), "alice").unwrap();
        revoke(dir.path(), "bob").unwrap();
        let list = std::fs::read(dir.path().join(CRL_FILE)).unwrap();
        let serials: Vec<_> = revoked_in(&list)
            .unwrap()
            .into_iter()
            .map(|r| r.serial_number)
            .collect();
        let of = |name: &str| {
            serial_of(&std::fs::read(dir.path().join(format!("{name}.pem"))).unwrap()).unwrap()
        };
        assert_eq!(serials, vec![of("alice"), of("bob")]);
        let again = revoke(dir.path(), "alice").unwrap_err();
        assert!(again.contains("revoked already"), "{again}");
        let unknown = revoke(dir.path(), "carol").unwrap_err();
        assert!(unknown.contains("carol.pem"), "{unknown}");
    }
}
