//! The server's libp2p identity and WebRTC certificate, kept in files so
//! that its peer id and certhash survive restarts.

use std::path::Path;

use corolla_shared::native::{new_webrtc_certificate, WebRtcCertificate};
use libp2p::identity::Keypair;

use crate::error::ServerError;

/// Loads the keypair in `path`, or creates it (readable by the owner only).
pub fn load_or_create_keypair(path: Option<&Path>) -> Result<Keypair, ServerError> {
    let Some(path) = path else {
        return Ok(Keypair::generate_ed25519());
    };
    if path.exists() {
        let bytes = std::fs::read(path)
            .map_err(|e| ServerError::Identity(format!("{}: {e}", path.display())))?;
        return Keypair::from_protobuf_encoding(&bytes).map_err(|e| {
            ServerError::Identity(format!("{} is not a libp2p key: {e}", path.display()))
        });
    }
    let key = Keypair::generate_ed25519();
    let bytes = key
        .to_protobuf_encoding()
        .map_err(|e| ServerError::Identity(e.to_string()))?;
    write_private(path, &bytes)?;
    Ok(key)
}

/// The WebRTC certificate beside the identity file (`FILE.webrtc.pem`), or a fresh one.
pub fn load_or_create_certificate(
    identity: Option<&Path>,
) -> Result<WebRtcCertificate, ServerError> {
    let Some(identity) = identity else {
        return new_webrtc_certificate().map_err(ServerError::Identity);
    };
    let path = identity.with_extension("webrtc.pem");
    if path.exists() {
        let pem = std::fs::read_to_string(&path)
            .map_err(|e| ServerError::Identity(format!("{}: {e}", path.display())))?;
        return WebRtcCertificate::from_pem(&pem)
            .map_err(|e| ServerError::Identity(format!("{}: {e}", path.display())));
    }
    let cert = new_webrtc_certificate().map_err(ServerError::Identity)?;
    write_private(&path, cert.serialize_pem().as_bytes())?;
    Ok(cert)
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), ServerError> {
    let err =
        |e: std::io::Error| ServerError::Identity(format!("cannot write {}: {e}", path.display()));
    std::fs::write(path, bytes).map_err(err)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    Ok(())
}
