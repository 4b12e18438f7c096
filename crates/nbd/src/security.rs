//! Who may talk plain NBD: TLS (NBD_OPT_STARTTLS) is offered when the server has a
//! certificate or pre-shared keys, and required of a client that is not on loopback
//! unless the operator allows plain NBD there.

use crate::psk::PskKeys;
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Clone, Default)]
pub struct Security {
    /// The server's TLS set-up; `None`: no STARTTLS.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Pre-shared keys for TLS-PSK clients; `None`: X.509 only.
    pub psk: Option<Arc<PskKeys>>,
    /// Plain NBD from clients not on loopback (on loopback it is always allowed).
    pub allow_plain: bool,
}

/// What one connection may do before and after STARTTLS.
pub(crate) struct Transport {
    pub(crate) tls: Option<Arc<rustls::ServerConfig>>,
    pub(crate) psk: Option<Arc<PskKeys>>,
    /// The connection is TLS now.
    pub(crate) secured: bool,
    /// Options other than STARTTLS and ABORT are served without TLS.
    pub(crate) plain_allowed: bool,
}

impl Security {
    pub(crate) fn transport(&self, peer: Option<SocketAddr>) -> Transport {
        let loopback = peer.is_some_and(|p| p.ip().is_loopback());
        Transport {
            tls: self.tls.clone(),
            psk: self.psk.clone(),
            secured: false,
            plain_allowed: loopback || self.allow_plain,
        }
    }
}

impl Transport {
    /// Whether STARTTLS can be served.
    pub(crate) fn offers_tls(&self) -> bool {
        self.tls.is_some() || self.psk.is_some()
    }

    /// Why an option other than STARTTLS or ABORT is refused now, if it is.
    pub(crate) fn refusal(&self) -> Option<&'static str> {
        match (self.secured || self.plain_allowed, self.offers_tls()) {
            (true, _) => None,
            (false, true) => Some("TLS is required from clients not on loopback: use STARTTLS (nbds://)"),
            (false, false) => Some(
                "plain NBD is served to clients on loopback only, and this server has no certificate or keys for TLS",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::{self, Negotiated};
    use crate::input::Input;
    use crate::proto::*;
    use crate::{Client, Exports, Refusal};
    use async_trait::async_trait;
    use bytes::{Buf, BufMut, BytesMut};
    use floe_blockdev::BlockDevice;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct NoExports;

    #[async_trait]
    impl Exports for NoExports {
        async fn list(&self) -> Result<Vec<String>, String> {
            Ok(vec!["disk".into()])
        }
        async fn open(&self, _: &str, _: &Client) -> Result<Arc<dyn BlockDevice>, Refusal> {
            Err(Refusal::Unknown("the test opens nothing".into()))
        }
    }

    fn option(out: &mut BytesMut, option: u32, data: &[u8]) {
        out.put_u64(IHAVEOPT);
        out.put_u32(option);
        out.put_u32(data.len() as u32);
        out.put_slice(data);
    }

    /// The server's answers, in order, to `options` sent in the clear by a client at
    /// `peer`, and how haggling ended.
    async fn haggle(security: &Security, peer: &str, options: &[(u32, &[u8])]) -> (Vec<u32>, bool) {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let (read, mut write) = tokio::io::split(server);
        let mut input = Input::new(read);
        let transport = security.transport(Some(peer.parse().unwrap()));
        let mut sent = BytesMut::new();
        sent.put_u32(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        for (code, data) in options {
            option(&mut sent, *code, data);
        }
        client.write_all(&sent).await.unwrap();
        drop(sent);
        let mut state = handshake::greet(&mut input, &mut write)
            .await
            .unwrap()
            .unwrap();
        let ended = handshake::negotiate(
            &mut input,
            &mut write,
            &NoExports,
            &mut state,
            &transport,
            &Client::default(),
        )
        .await;
        let started_tls = matches!(ended, Ok(Negotiated::StartTls));
        drop(write);
        drop(input);
        let mut replies = Vec::new();
        client.read_to_end(&mut replies).await.unwrap();
        let mut replies = &replies[18..]; // the greeting
        let mut kinds = Vec::new();
        while replies.len() >= 20 {
            replies.advance(12);
            kinds.push(replies.get_u32());
            let len = replies.get_u32() as usize;
            replies.advance(len);
        }
        (kinds, started_tls)
    }

    fn tls_config() -> Arc<rustls::ServerConfig> {
        // Never used for a handshake here: STARTTLS only has to be acknowledged.
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let resolver = Arc::new(rustls::server::ResolvesServerCertUsingSni::new());
        Arc::new(
            rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_cert_resolver(resolver),
        )
    }

    #[tokio::test]
    async fn a_remote_client_must_start_tls_before_anything_else() {
        let security = Security {
            tls: Some(tls_config()),
            psk: None,
            allow_plain: false,
        };
        let (replies, started) = haggle(
            &security,
            "10.1.2.3:5000",
            &[(OPT_LIST, b""), (OPT_STARTTLS, b"")],
        )
        .await;
        assert_eq!(replies, [REP_ERR_TLS_REQD, REP_ACK]);
        assert!(started);
        // On loopback, plain NBD is served.
        let (replies, _) = haggle(
            &security,
            "127.0.0.1:5000",
            &[(OPT_LIST, b""), (OPT_ABORT, b"")],
        )
        .await;
        assert_eq!(replies, [REP_SERVER, REP_ACK, REP_ACK]);
    }

    #[tokio::test]
    async fn without_a_certificate_a_remote_client_is_refused_unless_plain_is_allowed() {
        let refusing = Security::default();
        let (replies, started) = haggle(
            &refusing,
            "10.1.2.3:5000",
            &[(OPT_STARTTLS, b""), (OPT_LIST, b""), (OPT_ABORT, b"")],
        )
        .await;
        assert_eq!(replies, [REP_ERR_POLICY, REP_ERR_TLS_REQD, REP_ACK]);
        assert!(!started);
        let allowing = Security {
            tls: None,
            psk: None,
            allow_plain: true,
        };
        let (replies, _) = haggle(
            &allowing,
            "10.1.2.3:5000",
            &[(OPT_LIST, b""), (OPT_ABORT, b"")],
        )
        .await;
        assert_eq!(replies, [REP_SERVER, REP_ACK, REP_ACK]);
    }
}
