//! A throwaway PKI for the TLS tests, made with the `openssl` command line (as an operator
//! would, and independently of the rustls code under test): CAs, server certificates for
//! `localhost` and 127.0.0.1, client certificates. EC P-256 keys, in PKCS#8 PEM, valid two days.
//! Shared by tests/tls.rs and schema/tests/tls.rs.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// Serial numbers of the certificates issued, each different.
static SERIAL: AtomicU64 = AtomicU64::new(2);

/// A CA: its certificate (what clients trust) and its key (what it signs with).
pub struct Ca {
    pub cert: PathBuf,
    key: PathBuf,
    dir: PathBuf,
    name: String,
}

/// A certificate the CA issued, with its key.
#[derive(Clone)]
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Leaf {
    /// Copies the certificate and key over `cert` and `key` (the files a server was told to
    /// read), key first, as a renewal tool writing them one after the other would.
    pub fn install(&self, cert: &Path, key: &Path) {
        std::fs::copy(&self.key, key).unwrap();
        std::fs::copy(&self.cert, cert).unwrap();
    }

    /// The certificate in DER, as a TLS peer presents it.
    pub fn der(&self) -> Vec<u8> {
        openssl(
            self.cert.parent().unwrap(),
            &[
                "x509",
                "-in",
                self.cert.to_str().unwrap(),
                "-outform",
                "DER",
            ],
        )
    }
}

fn openssl(dir: &Path, args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command line is installed");
    assert!(
        out.status.success(),
        "openssl {}:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

const EC: [&str; 4] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"];

impl Ca {
    /// A new self-signed CA named `name`, its files in `dir`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let (cert, key) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        let mut args = vec!["req", "-x509", "-nodes", "-days", "2"];
        args.extend(EC);
        let subject = format!("/CN={name}");
        args.extend([
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            cert.to_str().unwrap(),
            "-subj",
            &subject,
        ]);
        openssl(dir, &args);
        Self {
            cert,
            key,
            dir: dir.to_path_buf(),
            name: name.to_string(),
        }
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    pub fn server(&self, name: &str) -> Leaf {
        self.issue(
            name,
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        )
    }

    /// A client certificate for `name`.
    pub fn client(&self, name: &str) -> Leaf {
        self.issue(name, "extendedKeyUsage=clientAuth\n")
    }

    fn issue(&self, name: &str, extensions: &str) -> Leaf {
        let stem = format!("{}-{name}", self.name);
        let (cert, key, csr, ext) = (
            self.dir.join(format!("{stem}.pem")),
            self.dir.join(format!("{stem}.key")),
            self.dir.join(format!("{stem}.csr")),
            self.dir.join(format!("{stem}.ext")),
        );
        std::fs::write(
            &ext,
            format!(
                "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n{extensions}"
            ),
        )
        .unwrap();
        let mut args = vec!["req", "-new", "-nodes"];
        args.extend(EC);
        let subject = format!("/CN={name}");
        args.extend([
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            csr.to_str().unwrap(),
            "-subj",
            &subject,
        ]);
        openssl(&self.dir, &args);
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed).to_string();
        openssl(
            &self.dir,
            &[
                "x509",
                "-req",
                "-in",
                csr.to_str().unwrap(),
                "-CA",
                self.cert.to_str().unwrap(),
                "-CAkey",
                self.key.to_str().unwrap(),
                "-set_serial",
                &serial,
                "-days",
                "2",
                "-extfile",
                ext.to_str().unwrap(),
                "-out",
                cert.to_str().unwrap(),
            ],
        );
        Leaf { cert, key }
    }
}
