//! `--tls-cert`/`--tls-key`: the certificate that lets pages served over
//! https reach this server, as `wss` for libp2p and https for the HTTP side
//! (an https page may not fetch the model from an http URL).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use corolla_http::HttpLimits;
use corolla_shared::native::WebSocketTls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::error::ServerError;

/// A PEM certificate chain and its private key.
pub struct TlsIdentity {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

/// Connections whose handshake is done but that axum has not taken yet.
const ACCEPT_QUEUE: usize = 64;

fn tls_error(path: &Path, what: &str, e: impl std::fmt::Display) -> ServerError {
    ServerError::Tls(format!("{}: {what}: {e}", path.display()))
}

impl TlsIdentity {
    pub fn load(cert: &Path, key: &Path) -> Result<Self, ServerError> {
        let certs = CertificateDer::pem_file_iter(cert)
            .map_err(|e| tls_error(cert, "cannot read the certificate", e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tls_error(cert, "not a PEM certificate chain", e))?;
        if certs.is_empty() {
            return Err(tls_error(
                cert,
                "no certificate",
                "the file has no CERTIFICATE block",
            ));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| tls_error(key, "not a PEM private key", e))?;
        let identity = TlsIdentity { certs, key };
        // Fail at start-up, not at the first browser's handshake.
        identity.server_config()?;
        Ok(identity)
    }

    /// For the libp2p WebSocket transport's `/tls/ws` listeners.
    pub fn websocket(&self) -> Result<WebSocketTls, ServerError> {
        let key = libp2p::websocket::tls::PrivateKey::new(self.key.secret_der().to_vec());
        let certs = self
            .certs
            .iter()
            .map(|c| libp2p::websocket::tls::Certificate::new(c.to_vec()));
        WebSocketTls::new(key, certs).map_err(|e| ServerError::Tls(e.to_string()))
    }

    fn server_config(&self) -> Result<rustls::ServerConfig, ServerError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|b| {
                b.with_no_client_auth()
                    .with_single_cert(self.certs.clone(), self.key.clone_key())
            })
            .map_err(|e| ServerError::Tls(format!("certificate and key: {e}")))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// An https listener for `corolla_http::serve_bounded`: handshakes run in their own tasks
/// (within the header deadline), so a slow or silent client never holds up the others,
/// and no more of them at once than connections are served: a flood of silent sockets
/// meets the same cap as on plain HTTP instead of a task and a socket each.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
}

impl TlsListener {
    pub fn new(
        listener: TcpListener,
        identity: &TlsIdentity,
        limits: &HttpLimits,
    ) -> Result<Self, ServerError> {
        let acceptor = TlsAcceptor::from(Arc::new(identity.server_config()?));
        let (tx, ready) = mpsc::channel(ACCEPT_QUEUE);
        let handshakes = Arc::new(Semaphore::new(limits.max_connections.max(1)));
        let deadline = limits.header_timeout;
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: wait, do not spin.
                        tracing::warn!(error = %e, "HTTPS accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    break;
                }
                let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                    tracing::debug!(%peer, "TLS handshake refused: as many are under way as connections are served");
                    drop(tcp);
                    continue;
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let handshake = tokio::time::timeout(deadline, acceptor.accept(tcp)).await;
                    drop(permit);
                    match handshake {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready })
    }
}

impl corolla_http::Accept for TlsListener {
    type Io = TlsStream<TcpStream>;

    async fn accept(&mut self) -> std::io::Result<(Self::Io, Option<std::net::IpAddr>)> {
        match self.ready.recv().await {
            Some((conn, from)) => Ok((conn, Some(from.ip()))),
            None => std::future::pending().await,
        }
    }
}
