//! Mutual TLS between Floe processes. Every certificate comes from the cluster's CA
//! (`floe cert`); its subject's organizational unit is its holder's [`Role`], which
//! says what the holder may ask (see [`crate::server::Handler::permits`]).
//!
//! A process installs its identity once, at start ([`install`]); from then on every
//! connection it opens or accepts is TLS 1.3 with both certificates checked against
//! the CA. A client does not match the server's certificate against the address it
//! dialled: processes reach each other by whatever address the cluster map holds,
//! and the CA signs only the cluster's own processes.

use crate::frame::Integrity;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::RootCertStore;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::net::TcpStream;

mod revocation;
use revocation::Revocations;
pub use revocation::CRL_FILE;

/// How long an accepted connection may take to finish its handshake.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// What a certificate's holder is to the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Master,
    Chunkserver,
    Gateway,
    /// An operator: the CLI's volume, snapshot and cluster changes.
    Admin,
    /// An NBD client of the gateways (a VM's host); no process of the cluster
    /// serves it anything else.
    Client,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Master,
        Role::Chunkserver,
        Role::Gateway,
        Role::Admin,
        Role::Client,
    ];
    /// The roles of the cluster's own processes and operators.
    pub const CLUSTER: [Role; 4] = [Role::Master, Role::Chunkserver, Role::Gateway, Role::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Role::Master => "master",
            Role::Chunkserver => "chunkserver",
            Role::Gateway => "gateway",
            Role::Admin => "admin",
            Role::Client => "client",
        }
    }

    pub fn parse(name: &str) -> Result<Role, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown role {name:?} (one of master, chunkserver, gateway, admin, client)"
                )
            })
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Who is on the other end of a connection, from its certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    /// The certificate's common name.
    pub name: String,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.role, self.name)
    }
}

impl Identity {
    /// The identity a certificate names (its CN and OU).
    pub fn of(certificate: &[u8]) -> Result<Identity, String> {
        let (_, parsed) = x509_parser::parse_x509_certificate(certificate)
            .map_err(|e| format!("unreadable certificate: {e}"))?;
        fn text(value: &x509_parser::x509::AttributeTypeAndValue<'_>) -> Option<String> {
            value.as_str().ok().map(str::to_string)
        }
        let subject = parsed.subject();
        let role = subject
            .iter_organizational_unit()
            .find_map(text)
            .ok_or("the certificate names no role (its subject has no OU)")?;
        let name = subject
            .iter_common_name()
            .find_map(text)
            .unwrap_or_default();
        Ok(Identity {
            role: Role::parse(&role)?,
            name,
        })
    }
}

/// A process's TLS set-up: its certificate, and the CA it trusts.
pub struct Tls {
    pub identity: Identity,
    pub client: Arc<rustls::ClientConfig>,
    pub server: Arc<rustls::ServerConfig>,
    /// For NBD clients (a gateway's STARTTLS): TLS 1.2 or 1.3, a certificate from
    /// the CA optional (an export's access list may ask for one).
    pub nbd: Arc<rustls::ServerConfig>,
}

static INSTALLED: OnceLock<Tls> = OnceLock::new();

/// This process's TLS set-up, if it runs with TLS.
pub fn installed() -> Option<&'static Tls> {
    INSTALLED.get()
}

/// Loads the CA certificate at `ca` and this process's certificate and key (one PEM
/// file, `cert`); every connection from here on is TLS. Once per process.
pub fn install(ca: &Path, cert: &Path) -> Result<&'static Identity, String> {
    let tls = Tls::load(ca, cert)?;
    INSTALLED
        .set(tls)
        .map_err(|_| "TLS is already set up in this process".to_string())?;
    Ok(&INSTALLED.get().expect("just set").identity)
}

impl Tls {
    pub fn load(ca: &Path, cert: &Path) -> Result<Tls, String> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
        };
        let (ca_pem, cert_pem) = (read(ca)?, read(cert)?);
        let mut roots = RootCertStore::empty();
        for der in CertificateDer::pem_slice_iter(&ca_pem) {
            let der = der.map_err(|e| format!("{}: {e}", ca.display()))?;
            roots
                .add(der)
                .map_err(|e| format!("{}: not a CA certificate: {e}", ca.display()))?;
        }
        if roots.is_empty() {
            return Err(format!("{} holds no certificate", ca.display()));
        }
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", cert.display()))?;
        let first = chain
            .first()
            .ok_or_else(|| format!("{} holds no certificate", cert.display()))?;
        let identity = Identity::of(first).map_err(|e| format!("{}: {e}", cert.display()))?;
        let key = PrivateKeyDer::from_pem_slice(&cert_pem)
            .map_err(|e| format!("{}: no private key: {e}", cert.display()))?;
        let provider = Arc::new(provider());
        let roots = Arc::new(roots);
        let tls13 = &[&rustls::version::TLS13];
        let failed = |e: rustls::Error| format!("{}: {e}", cert.display());
        let revocations = Revocations::load(roots, provider.clone(), ca)?;
        let client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(tls13)
            .map_err(failed)?
            .dangerous()
            .with_custom_certificate_verifier(revocations.servers())
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(failed)?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(tls13)
            .map_err(failed)?
            .with_client_cert_verifier(revocations.clients(false))
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(failed)?;
        server.ignore_client_order = true;
        let mut nbd = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(failed)?
            .with_client_cert_verifier(revocations.clients(true))
            .with_single_cert(chain, key)
            .map_err(failed)?;
        nbd.ignore_client_order = true;
        Ok(Tls {
            identity,
            client: Arc::new(client),
            server: Arc::new(server),
            nbd: Arc::new(nbd),
        })
    }

    /// The name a client hands rustls: unused by the verifier, which checks the CA
    /// and not the address.
    pub fn server_name() -> ServerName<'static> {
        ServerName::try_from("floe").expect("a valid DNS name")
    }
}

/// The peer's identity on an established connection.
pub fn peer_identity(connection: &rustls::CommonState) -> Result<Identity, String> {
    let certificate = connection
        .peer_certificates()
        .and_then(|c| c.first())
        .ok_or("no certificate")?;
    Identity::of(certificate)
}

/// The two halves of a connection, plain or TLS, and what guards its frames: decided
/// here, with the transport, so both ends of every connection decide alike.
pub(crate) struct Halves {
    pub(crate) read: Box<dyn AsyncRead + Send + Unpin>,
    pub(crate) write: Box<dyn AsyncWrite + Send + Unpin>,
    pub(crate) integrity: Integrity,
}

fn sealed<S: AsyncRead + AsyncWrite + Send + 'static>(stream: S) -> Halves {
    let (read, write) = tokio::io::split(stream);
    Halves {
        read: Box::new(read),
        write: Box::new(write),
        integrity: Integrity::Sealed,
    }
}

fn plain(stream: TcpStream) -> Halves {
    let (read, write) = stream.into_split();
    Halves {
        read: Box::new(read),
        write: Box::new(write),
        integrity: Integrity::Crc,
    }
}

/// The client's side of a fresh connection: TLS as the holder of `tls`, if given.
/// aws-lc-rs's suites with AES-128-GCM first (servers pick by their own order): every
/// byte of a replicated write is sealed and opened once per hop. On this project's
/// machines aws-lc-rs seals about 1.6x as fast as ring, and AES-128 costs about a
/// sixth less than AES-256.
fn provider() -> rustls::crypto::CryptoProvider {
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    provider.cipher_suites.sort_by_key(|suite| {
        use rustls::CipherSuite::*;
        !matches!(
            suite.suite(),
            TLS13_AES_128_GCM_SHA256
                | TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                | TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
        )
    });
    provider
}

/// What a TLS connection reads from its socket at once. rustls asks for at most 4 KiB
/// a read: without a buffer beneath it, a 1 MiB write costs each hop some 256 recv
/// calls instead of a handful.
const SOCKET_READ_BUFFER_BYTES: usize = 256 << 10;

fn buffered(stream: TcpStream) -> BufReader<TcpStream> {
    BufReader::with_capacity(SOCKET_READ_BUFFER_BYTES, stream)
}

pub(crate) async fn connect(stream: TcpStream, tls: Option<&Tls>) -> std::io::Result<Halves> {
    let Some(tls) = tls else {
        return Ok(plain(stream));
    };
    let stream = tokio_rustls::TlsConnector::from(tls.client.clone())
        .connect(Tls::server_name(), buffered(stream))
        .await?;
    Ok(sealed(stream))
}

/// The server's side of an accepted connection, with the client's identity when
/// this process runs with TLS (a client without a certificate from the CA fails).
pub(crate) async fn accept(stream: TcpStream) -> Result<(Halves, Option<Identity>), String> {
    let Some(tls) = installed() else {
        return Ok((plain(stream), None));
    };
    let accepting = tokio_rustls::TlsAcceptor::from(tls.server.clone()).accept(buffered(stream));
    let stream = tokio::time::timeout(HANDSHAKE_LIMIT, accepting)
        .await
        .map_err(|_| format!("no TLS handshake within {HANDSHAKE_LIMIT:?}"))?
        .map_err(
            |e| match e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
                Some(rustls::Error::InvalidMessage(_)) => {
                    "it does not speak TLS (a process without --ca and --cert?)".to_string()
                }
                _ => format!("TLS handshake failed: {e}"),
            },
        )?;
    let identity = peer_identity(stream.get_ref().1)?;
    Ok((sealed(stream), Some(identity)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aes_128_gcm_is_preferred_in_both_versions() {
        let suites: Vec<_> = provider().cipher_suites.iter().map(|s| s.suite()).collect();
        assert_eq!(suites[0], rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        let tls12 = suites
            .iter()
            .position(|s| !format!("{s:?}").starts_with("TLS13"))
            .expect("TLS 1.2 suites");
        assert!(format!("{:?}", suites[tls12]).contains("AES_128_GCM"));
        assert_eq!(
            suites.len(),
            rustls::crypto::aws_lc_rs::default_provider()
                .cipher_suites
                .len()
        );
    }
}
