//! The server's libp2p identity and WebRTC certificate, kept in files so
//! that its peer id and certhash survive restarts. The files hold private
//! keys: they are created readable by the owner only, all at once (a crash
//! never leaves half a key), and a server refuses to start from files other
//! users can read unless told to (`--allow-shared-identity`).

use std::io::Write;
use std::path::{Path, PathBuf};

use corolla_shared::native::{new_webrtc_certificate, WebRtcCertificate};
use libp2p::identity::Keypair;

use crate::error::ServerError;

/// Loads the keypair in `path`, or creates it (readable by the owner only).
/// `allow_shared`: start even when others may read the file.
pub fn load_or_create_keypair(
    path: Option<&Path>,
    allow_shared: bool,
) -> Result<Keypair, ServerError> {
    let Some(path) = path else {
        return Ok(Keypair::generate_ed25519());
    };
    if path.exists() {
        check_private(path, allow_shared)?;
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

/// The WebRTC certificate beside the identity file (its name with the
/// extension replaced: `identity.key` -> `identity.webrtc.pem`), or a fresh one.
pub fn load_or_create_certificate(
    identity: Option<&Path>,
    allow_shared: bool,
) -> Result<WebRtcCertificate, ServerError> {
    let Some(identity) = identity else {
        return new_webrtc_certificate().map_err(ServerError::Identity);
    };
    let path = identity.with_extension("webrtc.pem");
    if path.exists() {
        check_private(&path, allow_shared)?;
        let pem = std::fs::read_to_string(&path)
            .map_err(|e| ServerError::Identity(format!("{}: {e}", path.display())))?;
        return WebRtcCertificate::from_pem(&pem)
            .map_err(|e| ServerError::Identity(format!("{}: {e}", path.display())));
    }
    let cert = new_webrtc_certificate().map_err(ServerError::Identity)?;
    write_private(&path, cert.serialize_pem().as_bytes())?;
    Ok(cert)
}

/// Refuses a key file that group or others may read or write (as ssh does):
/// anyone who reads it can be this server.
#[cfg(unix)]
fn check_private(path: &Path, allow_shared: bool) -> Result<(), ServerError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)
        .map_err(|e| ServerError::Identity(format!("{}: {e}", path.display())))?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o077 == 0 {
        return Ok(());
    }
    if allow_shared {
        tracing::warn!(
            file = %path.display(),
            mode = format!("{mode:04o}"),
            "identity file is accessible to other users (--allow-shared-identity)"
        );
        return Ok(());
    }
    Err(ServerError::Identity(format!(
        "{file} has mode {mode:04o}: other users may read this server's private key. \
         Run `chmod 600 {file}` (or pass --allow-shared-identity, \
         COROLLA_ALLOW_SHARED_IDENTITY=true, to start anyway)",
        file = path.display()
    )))
}

#[cfg(not(unix))]
fn check_private(_path: &Path, _allow_shared: bool) -> Result<(), ServerError> {
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file in the same folder,
/// created with mode 0600 (never readable by others, not even for a moment)
/// and renamed over `path` once complete and synced.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), ServerError> {
    let err =
        |e: std::io::Error| ServerError::Identity(format!("cannot write {}: {e}", path.display()));
    let temp = temp_path(path);
    let written = (|| {
        let mut file = open_private(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(err(e));
    }
    // The rename itself survives a crash only once the folder is synced.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(dir) = std::fs::File::open(dir) {
            let _ = dir.sync_all();
        }
    }
    Ok(())
}

/// `.NAME.tmp-PID-RANDOM` beside `path`: hidden, and never one another
/// writer (or a stale file from a crash) holds.
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let nonce: u32 = rand::random();
    path.with_file_name(format!(".{name}.tmp-{}-{nonce:08x}", std::process::id()))
}

fn open_private(path: &Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    options.open(path)
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    fn set_mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn created_files_are_the_owners_alone_and_nothing_else_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.key");
        let key = load_or_create_keypair(Some(&path), false).unwrap();
        load_or_create_certificate(Some(&path), false).unwrap();
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&path.with_extension("webrtc.pem")), 0o600);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "no temporary file left: {names:?}");
        // Loaded again: the same peer.
        let again = load_or_create_keypair(Some(&path), false).unwrap();
        assert_eq!(again.public(), key.public());
    }

    #[test]
    fn files_others_can_read_are_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.key");
        load_or_create_keypair(Some(&path), false).unwrap();
        set_mode(&path, 0o644);
        let message = load_or_create_keypair(Some(&path), false)
            .unwrap_err()
            .to_string();
        let shown = path.display().to_string();
        assert!(message.contains(&shown), "{message}");
        assert!(message.contains("0644"), "{message}");
        assert!(message.contains(&format!("chmod 600 {shown}")), "{message}");

        // The certificate beside it is checked the same way.
        set_mode(&path, 0o600);
        let pem = path.with_extension("webrtc.pem");
        load_or_create_certificate(Some(&path), false).unwrap();
        set_mode(&pem, 0o640);
        let message = load_or_create_certificate(Some(&path), false)
            .unwrap_err()
            .to_string();
        assert!(message.contains(&pem.display().to_string()), "{message}");
        assert!(message.contains("0640"), "{message}");
    }

    #[test]
    fn allow_shared_identity_starts_anyway() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.key");
        let key = load_or_create_keypair(Some(&path), false).unwrap();
        load_or_create_certificate(Some(&path), false).unwrap();
        set_mode(&path, 0o644);
        set_mode(&path.with_extension("webrtc.pem"), 0o644);
        let again = load_or_create_keypair(Some(&path), true).unwrap();
        assert_eq!(again.public(), key.public());
        load_or_create_certificate(Some(&path), true).unwrap();
    }

    /// A damaged key or certificate stops the server with the file named,
    /// rather than a new identity replacing the one its peers know.
    #[test]
    fn files_that_are_not_keys_are_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.key");
        std::fs::write(&path, b"not a key at all").unwrap();
        set_mode(&path, 0o600);
        let message = load_or_create_keypair(Some(&path), false)
            .unwrap_err()
            .to_string();
        assert!(message.contains("is not a libp2p key"), "{message}");
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a key at all");

        let pem = path.with_extension("webrtc.pem");
        std::fs::write(&pem, "-----BEGIN NOTHING-----\n").unwrap();
        set_mode(&pem, 0o600);
        let message = load_or_create_certificate(Some(&path), false)
            .unwrap_err()
            .to_string();
        assert!(message.contains(&pem.display().to_string()), "{message}");
        assert_eq!(
            std::fs::read_to_string(&pem).unwrap(),
            "-----BEGIN NOTHING-----\n"
        );
    }
}
