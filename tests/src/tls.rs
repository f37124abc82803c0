//! Test certificates for the `--tls-cert`/`--tls-key` servers (openssl).

use std::path::Path;

/// A self-signed certificate for `ip`, as `--tls-cert`/`--tls-key` take it.
pub struct TestTls {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

impl TestTls {
    pub fn args(&self) -> [&str; 4] {
        [
            "--tls-cert",
            self.cert.to_str().unwrap(),
            "--tls-key",
            self.key.to_str().unwrap(),
        ]
    }
}

pub fn test_certificate(dir: &Path, ip: &str) -> TestTls {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "2", "-subj", "/CN=corolla-test"])
        .args(["-addext", &format!("subjectAltName=IP:{ip}")])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(made, "openssl could not make a test certificate");
    TestTls { cert, key }
}
