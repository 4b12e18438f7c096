//! TLS with pre-shared keys (TLS-PSK), as QEMU (`tls-creds-psk`) and libnbd
//! (`tls-psk-file`) speak it. rustls has no external PSKs, so these handshakes go to
//! OpenSSL; which stack takes a handshake is decided from the ClientHello: one that
//! offers an identity of the key file is PSK, anything else X.509 (rustls).
//!
//! Keys are in the format of GnuTLS's `psktool`, the file QEMU and libnbd read:
//! one `IDENTITY:HEXKEY` a line.

use openssl::ssl::{Ssl, SslContext, SslMethod, SslVersion};
use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_openssl::SslStream;

/// The largest ClientHello record read before the handshake is handed on (TLS's
/// record limit plus what a compressed or padded record may add).
const MAX_RECORD: usize = (1 << 14) + 2048;
/// TLS 1.3's `pre_shared_key` extension (RFC 8446 section 4.2.11).
const EXTENSION_PRE_SHARED_KEY: u16 = 41;

/// Pre-shared keys by identity.
pub struct PskKeys {
    keys: BTreeMap<Vec<u8>, Vec<u8>>,
    context: SslContext,
}

impl std::fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        f.debug_struct("PskKeys")
            .field("identities", &self.keys.len())
            .finish()
    }
}

/// Where the PSK callback leaves the identity it accepted, per connection.
fn identity_index() -> openssl::ex_data::Index<Ssl, String> {
    static INDEX: OnceLock<openssl::ex_data::Index<Ssl, String>> = OnceLock::new();
    *INDEX.get_or_init(|| Ssl::new_ex_index().expect("OpenSSL ex-data index"))
}

impl PskKeys {
    pub fn load(path: &Path) -> Result<Arc<PskKeys>, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        PskKeys::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Arc<PskKeys>, String> {
        let mut keys = BTreeMap::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let key = line
                .split_once(':')
                .filter(|(identity, _)| !identity.is_empty())
                .and_then(|(identity, key)| Some((identity, hex(key)?)))
                .filter(|(_, key)| (16..=64).contains(&key.len()));
            let Some((identity, key)) = key else {
                return Err(format!(
                    "line {}: expected IDENTITY:HEXKEY with a key of 16 to 64 bytes (psktool's format)",
                    number + 1
                ));
            };
            if keys.insert(identity.as_bytes().to_vec(), key).is_some() {
                return Err(format!("line {}: {identity} has a key already", number + 1));
            }
        }
        if keys.is_empty() {
            return Err("no keys".into());
        }
        let context = context(keys.clone()).map_err(|e| format!("OpenSSL: {e}"))?;
        Ok(Arc::new(PskKeys { keys, context }))
    }

    /// Whether the ClientHello in `record` offers one of these identities.
    pub(crate) fn offered(&self, record: &[u8]) -> bool {
        offered_identities(record)
            .unwrap_or_default()
            .iter()
            .any(|identity| self.keys.contains_key(*identity))
    }

    /// The server side of a PSK handshake on `stream`: the stream and the client's
    /// identity.
    pub(crate) async fn accept<S>(&self, stream: S) -> io::Result<(SslStream<S>, String)>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let ssl = Ssl::new(&self.context).map_err(io::Error::other)?;
        let mut stream = SslStream::new(ssl, stream).map_err(io::Error::other)?;
        Pin::new(&mut stream).accept().await.map_err(|e| {
            io::Error::new(io::ErrorKind::PermissionDenied, format!("TLS-PSK: {e}"))
        })?;
        let identity = stream
            .ssl()
            .ex_data(identity_index())
            .cloned()
            .ok_or_else(|| io::Error::other("TLS-PSK handshake ended without an identity"))?;
        Ok((stream, identity))
    }
}

/// TLS 1.3 only: what QEMU and libnbd (GnuTLS) offer; its PSK handshake also agrees
/// on an ephemeral key (psk_dhe_ke), so a leaked key does not expose past sessions.
fn context(keys: BTreeMap<Vec<u8>, Vec<u8>>) -> Result<SslContext, openssl::error::ErrorStack> {
    let mut builder = SslContext::builder(SslMethod::tls_server())?;
    builder.set_min_proto_version(Some(SslVersion::TLS1_3))?;
    // OpenSSL serves TLS 1.3 PSKs from this callback only with a SHA-256 suite.
    builder.set_ciphersuites("TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256")?;
    builder.set_psk_server_callback(move |ssl, identity, out| {
        let identity = identity.unwrap_or_default();
        let Some(key) = keys.get(identity) else {
            tracing::warn!(identity = %String::from_utf8_lossy(identity), "TLS-PSK: unknown identity");
            return Ok(0);
        };
        if key.len() > out.len() {
            return Ok(0);
        }
        out[..key.len()].copy_from_slice(key);
        ssl.set_ex_data(identity_index(), String::from_utf8_lossy(identity).into_owned());
        Ok(key.len())
    });
    Ok(builder.build())
}

fn hex(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Reads the client's first TLS record (its ClientHello), whole.
pub(crate) async fn read_first_record(read: &mut (impl AsyncRead + Unpin)) -> io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut record = vec![0u8; 5];
    read.read_exact(&mut record).await?;
    let length = u16::from_be_bytes([record[3], record[4]]) as usize;
    if record[0] != 22 || length > MAX_RECORD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "after STARTTLS the client sent no TLS handshake",
        ));
    }
    record.resize(5 + length, 0);
    read.read_exact(&mut record[5..]).await?;
    Ok(record)
}

/// The identities a ClientHello record offers in its `pre_shared_key` extension;
/// `None` if it is not a ClientHello or is cut short.
fn offered_identities(record: &[u8]) -> Option<Vec<&[u8]>> {
    let mut hello = Reader(record.get(5..)?);
    (hello.u8()? == 1).then_some(())?; // client_hello
    hello.take(3)?; // its length: the record may hold less, which is read as cut short
    hello.take(2 + 32)?; // legacy_version, random
    let n = hello.u8()? as usize;
    hello.take(n)?; // legacy_session_id
    let n = hello.u16()? as usize;
    hello.take(n)?; // cipher_suites
    let n = hello.u8()? as usize;
    hello.take(n)?; // legacy_compression_methods
    let n = hello.u16()? as usize;
    let mut extensions = Reader(hello.take(n)?);
    while !extensions.0.is_empty() {
        let kind = extensions.u16()?;
        let n = extensions.u16()? as usize;
        let mut data = Reader(extensions.take(n)?);
        if kind != EXTENSION_PRE_SHARED_KEY {
            continue;
        }
        let n = data.u16()? as usize;
        let mut list = Reader(data.take(n)?);
        let mut identities = Vec::new();
        while !list.0.is_empty() {
            let n = list.u16()? as usize;
            identities.push(list.take(n)?);
            list.take(4)?; // obfuscated_ticket_age
        }
        return Some(identities);
    }
    Some(Vec::new())
}

/// Big-endian fields off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: &str = "# made by psktool\nalice:0123456789abcdef0123456789abcdef\n";

    /// A ClientHello record with `extensions` (type, data).
    fn hello(extensions: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([7; 32]);
        body.push(0);
        body.extend([0, 2, 0x13, 0x01]);
        body.extend([1, 0]);
        let mut list = Vec::new();
        for (kind, data) in extensions {
            list.extend(kind.to_be_bytes());
            list.extend((data.len() as u16).to_be_bytes());
            list.extend(data);
        }
        body.extend((list.len() as u16).to_be_bytes());
        body.extend(list);
        let mut message = vec![1, 0, (body.len() >> 8) as u8, body.len() as u8];
        message.extend(body);
        let mut record = vec![22, 3, 1];
        record.extend((message.len() as u16).to_be_bytes());
        record.extend(message);
        record
    }

    fn pre_shared_key(identities: &[&[u8]]) -> (u16, Vec<u8>) {
        let mut list = Vec::new();
        for identity in identities {
            list.extend((identity.len() as u16).to_be_bytes());
            list.extend(*identity);
            list.extend([0; 4]);
        }
        let mut data = (list.len() as u16).to_be_bytes().to_vec();
        data.extend(list);
        data.extend([0, 33, 32]); // binders: one of 32 bytes
        data.extend([0; 32]);
        (EXTENSION_PRE_SHARED_KEY, data)
    }

    #[test]
    fn a_hello_is_psk_when_it_offers_a_known_identity() {
        let keys = PskKeys::parse(KEYS).unwrap();
        let server_name = (0, b"\0\0\0".to_vec());
        assert!(keys.offered(&hello(&[server_name.clone(), pre_shared_key(&[b"alice"])])));
        assert!(keys.offered(&hello(&[pre_shared_key(&[b"ticket", b"alice"])])));
        // A resumption ticket, or no PSK at all: X.509.
        assert!(!keys.offered(&hello(&[pre_shared_key(&[b"\x01\x02ticket"])])));
        assert!(!keys.offered(&hello(&[server_name])));
        // Cut short anywhere: not PSK, and no panic.
        let whole = hello(&[pre_shared_key(&[b"alice"])]);
        for end in 0..whole.len() {
            assert!(!keys.offered(&whole[..end]), "cut at {end}");
        }
    }

    #[test]
    fn key_files_are_read_as_psktool_writes_them() {
        let keys = PskKeys::parse(KEYS).unwrap();
        assert_eq!(keys.keys[&b"alice"[..]].len(), 16);
        for bad in [
            "alice",
            ":00112233445566778899aabbccddeeff",
            "alice:0g",
            "alice:0011",
            "",
        ] {
            let error = PskKeys::parse(bad).unwrap_err();
            assert!(
                error.contains("line 1") || error == "no keys",
                "{bad:?}: {error}"
            );
        }
        let twice = format!("{KEYS}{KEYS}");
        assert!(PskKeys::parse(&twice)
            .unwrap_err()
            .contains("has a key already"));
    }
}
