//! `floe cert`: a cluster's CA and the certificates of its processes and operators
//! (see `floe_protocol::tls`: a certificate's OU is its holder's role).
//!
//! `DIR/ca.pem` is the CA's certificate, which every process trusts; `DIR/ca.key`
//! signs new certificates and stays with the operator. `DIR/NAME.pem` holds one
//! holder's certificate and its key; an NBD client's are also laid out in `DIR/NAME/`
//! as QEMU's `tls-creds-x509` and libnbd's `tls-certificates` read them.
//!
//! NBD clients may use a pre-shared key instead (TLS-PSK): `floe cert psk FILE NAME`
//! adds one to a key file in psktool's format, which the gateway (`--nbd-psk`),
//! QEMU's `tls-creds-psk` (as `DIR/keys.psk`) and libnbd's `tls-psk-file` all read.

mod revoke;

use clap::Subcommand;
use floe_protocol::tls::Role;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};

/// How long a CA and the certificates it issues are valid.
const CA_DAYS: i64 = 3650;
const DAYS_DEFAULT: i64 = 825;
/// Where a new certificate's validity starts: clocks of a cluster's hosts differ.
const CLOCK_SLACK: Duration = Duration::hours(1);

#[derive(Subcommand)]
pub enum CertCommand {
    /// Make a new cluster CA in DIR: ca.pem (give it to every process with --ca) and
    /// ca.key (signs certificates: keep it safe).
    Init {
        /// Directory for the CA's files (created if missing).
        dir: PathBuf,
    },
    /// Issue DIR/NAME.pem, a certificate and its key signed by DIR's CA, for one
    /// process or operator (give it with --cert).
    Issue {
        /// Directory holding the CA (from `floe cert init`).
        dir: PathBuf,
        /// Name of the holder (the certificate's common name), e.g. gateway-1.
        name: String,
        /// What the holder may do: master, chunkserver, gateway, admin, or client (an
        /// NBD client: also writes DIR/NAME/ for QEMU and libnbd).
        #[arg(long, value_parser = Role::parse)]
        role: Role,
        /// Host names and addresses the holder serves at, checked by NBD clients
        /// (comma-separated).
        #[arg(
            long = "host",
            value_delimiter = ',',
            default_value = "localhost,127.0.0.1"
        )]
        hosts: Vec<String>,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = DAYS_DEFAULT)]
        days: i64,
    },
    /// Revoke DIR/NAME.pem: adds it to the CA's revocation list DIR/crl.pem, which
    /// every process reads beside its --ca file at each new connection.
    Revoke {
        /// Directory holding the CA (from `floe cert init`).
        dir: PathBuf,
        /// The holder whose certificate is revoked (DIR/NAME.pem).
        name: String,
    },
    /// Add a random pre-shared key for NBD client NAME to FILE (created if missing),
    /// a line `NAME:HEXKEY`; give FILE to the gateway with --nbd-psk and to the client.
    Psk {
        /// The key file, e.g. keys.psk.
        file: PathBuf,
        /// The client's identity (its name in --nbd-access).
        name: String,
    },
}

pub fn run(command: CertCommand) -> Result<(), String> {
    match command {
        CertCommand::Init { dir } => {
            init(&dir)?;
            println!(
                "made a cluster CA: {} (give it to every process with --ca); {} signs \
                 certificates: keep it safe",
                dir.join("ca.pem").display(),
                dir.join("ca.key").display()
            );
        }
        CertCommand::Issue {
            dir,
            name,
            role,
            hosts,
            days,
        } => {
            let path = issue(&dir, &name, role, &hosts, days)?;
            println!("issued {} ({role} {name})", path.display());
        }
        CertCommand::Revoke { dir, name } => revoke::revoke(&dir, &name)?,
        CertCommand::Psk { file, name } => {
            add_psk(&file, &name)?;
            println!("added a key for {name} to {}", file.display());
        }
    }
    Ok(())
}

/// Makes a CA in `dir`; refuses to replace one (its certificates would be orphaned).
pub fn init(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let key = KeyPair::generate().map_err(|e| e.to_string())?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "Floe cluster CA");
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    valid_for(&mut params, CA_DAYS);
    let certificate = params.self_signed(&key).map_err(|e| e.to_string())?;
    write_new(&dir.join("ca.key"), &key.serialize_pem(), PRIVATE)?;
    write_new(&dir.join("ca.pem"), &certificate.pem(), 0o644)
}

/// Issues `dir/NAME.pem` for a holder of `role`; returns its path.
pub fn issue(
    dir: &Path,
    name: &str,
    role: Role,
    hosts: &[String],
    days: i64,
) -> Result<PathBuf, String> {
    if name.is_empty() || name.contains(['/', '\0']) || name == "ca" {
        return Err(format!("{name:?} cannot name a certificate file"));
    }
    let issuer = issuer(dir)?;
    let key = KeyPair::generate().map_err(|e| e.to_string())?;
    let mut params = CertificateParams::new(hosts.to_vec()).map_err(|e| format!("--host: {e}"))?;
    params.distinguished_name.push(DnType::CommonName, name);
    params
        .distinguished_name
        .push(DnType::OrganizationalUnitName, role.name());
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    valid_for(&mut params, days);
    let certificate = params.signed_by(&key, &issuer).map_err(|e| e.to_string())?;
    let path = dir.join(format!("{name}.pem"));
    write_new(&path, &(certificate.pem() + &key.serialize_pem()), PRIVATE)?;
    if role == Role::Client {
        let client = dir.join(name);
        std::fs::create_dir_all(&client)
            .map_err(|e| format!("cannot create {}: {e}", client.display()))?;
        write_new(&client.join("ca-cert.pem"), &ca_file(dir, "ca.pem")?, 0o644)?;
        write_new(&client.join("client-cert.pem"), &certificate.pem(), 0o644)?;
        write_new(
            &client.join("client-key.pem"),
            &key.serialize_pem(),
            PRIVATE,
        )?;
    }
    Ok(path)
}

/// One of the CA's files in `dir`.
fn ca_file(dir: &Path, file: &str) -> Result<String, String> {
    let path = dir.join(file);
    std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "cannot read {}: {e} (make a CA with `floe cert init {}`)",
            path.display(),
            dir.display()
        )
    })
}

/// The CA in `dir`, to sign with.
fn issuer(dir: &Path) -> Result<Issuer<'static, KeyPair>, String> {
    let key = KeyPair::from_pem(&ca_file(dir, "ca.key")?).map_err(|e| format!("ca.key: {e}"))?;
    Issuer::from_ca_cert_pem(&ca_file(dir, "ca.pem")?, key).map_err(|e| format!("ca.pem: {e}"))
}

fn valid_for(params: &mut CertificateParams, days: i64) {
    let now = OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SLACK;
    params.not_after = now + Duration::days(days);
}

/// Appends a new random 256-bit key for `name` to the key file `file`.
pub fn add_psk(file: &Path, name: &str) -> Result<(), String> {
    if name.is_empty() || name.contains([':', '\n']) {
        return Err(format!("{name:?} cannot name a pre-shared key"));
    }
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("cannot read {}: {e}", file.display())),
    };
    if text
        .lines()
        .any(|line| line.split(':').next() == Some(name))
    {
        return Err(format!("{} has a key for {name} already", file.display()));
    }
    let key: [u8; 32] = rand::random();
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(PRIVATE)
        .open(file)
        .map_err(|e| format!("cannot open {}: {e}", file.display()))?;
    writeln!(out, "{name}:{hex}").map_err(|e| format!("cannot write {}: {e}", file.display()))
}

/// The mode of a file holding a key.
const PRIVATE: u32 = 0o600;

/// Writes a new file; never replaces one.
fn write_new(path: &Path, text: &str, mode: u32) -> Result<(), String> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => {
                format!("{} exists: remove it first to replace it", path.display())
            }
            _ => format!("cannot create {}: {e}", path.display()),
        })?;
    file.write_all(text.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}
