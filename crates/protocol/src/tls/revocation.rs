//! Certificate revocation. The CA's revocation list, `crl.pem` beside `ca.pem`
//! (written by `floe cert revoke`), is read again whenever the file changes, so a
//! revoked holder is refused at its next handshake without restarting any process.
//! Connections already open stay open: revocation stops new ones.
//!
//! Every verifier a process uses (of servers it dials, of cluster clients, of NBD
//! clients) asks [`Revocations::current`] for the verifiers built from the list as it
//! is now. A list that cannot be read keeps the previous one in force and is logged:
//! a torn copy of the file must not open the cluster to revoked holders, nor close
//! it to everyone.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme,
};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The file name of the revocation list, in the CA certificate's directory.
pub const CRL_FILE: &str = "crl.pem";

/// The verifiers built from one version of the revocation list.
#[derive(Debug)]
struct Verifiers {
    servers: Arc<WebPkiServerVerifier>,
    cluster_clients: Arc<dyn ClientCertVerifier>,
    nbd_clients: Arc<dyn ClientCertVerifier>,
}

/// Which version of the list file the verifiers were built from: a rewrite by
/// `floe cert revoke` is a rename, so it changes the inode even within one mtime tick.
type Stamp = Option<(u64, i64, i64, u64)>;

#[derive(Debug)]
pub(super) struct Revocations {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
    path: PathBuf,
    current: Mutex<(Stamp, Arc<Verifiers>)>,
}

impl Revocations {
    /// The list beside the CA certificate `ca`; none there means nothing is revoked.
    /// One there that cannot be read is an error at start.
    pub(super) fn load(
        roots: Arc<RootCertStore>,
        provider: Arc<CryptoProvider>,
        ca: &Path,
    ) -> Result<Arc<Revocations>, String> {
        let path = ca.with_file_name(CRL_FILE);
        let stamp = stamp(&path);
        let verifiers = build(&roots, &provider, read(&path)?)?;
        Ok(Arc::new(Revocations {
            roots,
            provider,
            path,
            current: Mutex::new((stamp, Arc::new(verifiers))),
        }))
    }

    /// The verifiers for the list as the file holds it now.
    fn current(&self) -> Arc<Verifiers> {
        let stamp = stamp(&self.path);
        let mut current = self.current.lock().expect("revocations lock");
        if current.0 != stamp {
            // Recorded even on failure, so a bad file is logged once, not per handshake.
            current.0 = stamp;
            match read(&self.path).and_then(|crls| build(&self.roots, &self.provider, crls)) {
                Ok(verifiers) => {
                    tracing::info!("revocation list {} loaded", self.path.display());
                    current.1 = Arc::new(verifiers);
                }
                Err(e) => tracing::error!("{e}; the previous revocation list stays in force"),
            }
        }
        current.1.clone()
    }

    /// Verifies servers this process dials.
    pub(super) fn servers(self: &Arc<Self>) -> Arc<dyn ServerCertVerifier> {
        Arc::new(CheckedServers(self.clone()))
    }

    /// Verifies clients of the cluster's own connections (a certificate required), or
    /// NBD clients (a certificate optional).
    pub(super) fn clients(self: &Arc<Self>, nbd: bool) -> Arc<dyn ClientCertVerifier> {
        let first = self.current();
        let inner = if nbd {
            &first.nbd_clients
        } else {
            &first.cluster_clients
        };
        Arc::new(CheckedClients {
            revocations: self.clone(),
            nbd,
            mandatory: inner.client_auth_mandatory(),
            hints: inner.root_hint_subjects().to_vec(),
        })
    }
}

fn stamp(path: &Path) -> Stamp {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.ino(), meta.mtime(), meta.mtime_nsec(), meta.len()))
}

fn read(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, String> {
    let pem = match std::fs::read(path) {
        Ok(pem) => pem,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let crls = CertificateRevocationListDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if crls.is_empty() {
        return Err(format!("{} holds no revocation list", path.display()));
    }
    Ok(crls)
}

fn build(
    roots: &Arc<RootCertStore>,
    provider: &Arc<CryptoProvider>,
    crls: Vec<CertificateRevocationListDer<'static>>,
) -> Result<Verifiers, String> {
    // Only end entities are revoked: the CA is the trust anchor itself.
    let servers = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
        .with_crls(crls.clone())
        .only_check_end_entity_revocation()
        .build()
        .map_err(failed)?;
    let clients = || {
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .with_crls(crls.clone())
            .only_check_end_entity_revocation()
    };
    Ok(Verifiers {
        servers,
        cluster_clients: clients().build().map_err(failed)?,
        nbd_clients: clients().allow_unauthenticated().build().map_err(failed)?,
    })
}

fn failed(e: impl std::fmt::Display) -> String {
    format!("revocation list: {e}")
}

/// Checks a server's certificate chains to the cluster CA and is not revoked,
/// whatever address it was reached at.
#[derive(Debug)]
struct CheckedServers(Arc<Revocations>);

impl ServerCertVerifier for CheckedServers {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.current().servers.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .servers
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .servers
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.current().servers.supported_verify_schemes()
    }
}

/// Checks a client's certificate (when it offers one) against the CA and the list.
#[derive(Debug)]
struct CheckedClients {
    revocations: Arc<Revocations>,
    nbd: bool,
    mandatory: bool,
    /// The CA's names, sent to clients: they do not change with the list.
    hints: Vec<DistinguishedName>,
}

impl CheckedClients {
    fn inner(&self) -> Arc<dyn ClientCertVerifier> {
        let verifiers = self.revocations.current();
        match self.nbd {
            true => verifiers.nbd_clients.clone(),
            false => verifiers.cluster_clients.clone(),
        }
    }
}

impl ClientCertVerifier for CheckedClients {
    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner().supported_verify_schemes()
    }
}
