//! The TLS files: every certificate, key and CA file the config names is readable, a listener's
//! key is its certificate's (loaded as the listener loads them), and no certificate in them
//! expires within [`EXPIRY_MARGIN`].

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpuwarden_schema::clock::wall_now;
use gpuwarden_schema::config::{Config, TlsConfig};
use gpuwarden_schema::tls::ServerTls;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::CertificateDer;
use x509_cert::der::Decode as _;

use super::{span, Line};

/// A certificate that expires sooner than this fails: renewals (cert-manager, certbot) run a
/// month or more ahead, so one this close has a renewal that is not working.
pub(super) const EXPIRY_MARGIN: Duration = Duration::from_secs(14 * 86_400);

/// What a file is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Certificates (a server's or client's, then intermediates).
    Cert,
    /// A private key.
    Key,
    /// CA certificates to trust.
    Ca,
    /// Anything else to read (a PKCS#12 keystore, a CRL).
    Other,
}

/// A file the config names, by the field that names it.
struct Named {
    field: String,
    path: PathBuf,
    kind: Kind,
}

/// Every TLS file of `config`, by the section naming it, with the listener's settings when the
/// section is a listener's (whose key and certificate must pair up).
/// The files of one section, with the listener's section name and settings when it is one.
type Group = (Vec<Named>, Option<(String, TlsConfig)>);

fn named(config: &Config) -> Vec<Group> {
    let mut groups = Vec::new();
    let mut listener = |section: String, tls: &TlsConfig| {
        let mut files = vec![
            Named {
                field: format!("{section}.cert"),
                path: tls.cert.clone(),
                kind: Kind::Cert,
            },
            Named {
                field: format!("{section}.key"),
                path: tls.key.clone(),
                kind: Kind::Key,
            },
        ];
        if let Some(ca) = &tls.client_ca {
            files.push(Named {
                field: format!("{section}.client_ca"),
                path: ca.clone(),
                kind: Kind::Ca,
            });
        }
        groups.push((files, Some((section, tls.clone()))));
    };
    if let Some(tls) = &config.enforcer.tls {
        listener("enforcer.tls".into(), tls);
    }
    if let Some(tls) = &config.pipeline.sql_tls {
        listener("pipeline.sql_tls".into(), tls);
    }
    for substrate in &config.substrates {
        if let Some(kubernetes) = &substrate.kubernetes {
            listener(
                format!("substrates.{}.kubernetes.webhook_tls", substrate.name),
                &kubernetes.webhook_tls,
            );
        }
    }
    let mut others = Vec::new();
    if let Some(url) = &config.enforcer.store.url {
        if let Some(root) = url
            .split_once('?')
            .into_iter()
            .flat_map(|(_, query)| query.split('&'))
            .find_map(|pair| pair.strip_prefix("sslrootcert="))
        {
            others.push(Named {
                field: "enforcer.store.url sslrootcert".into(),
                path: PathBuf::from(root),
                kind: Kind::Ca,
            });
        }
    }
    for (property, kind) in [
        ("ssl.ca.location", Kind::Ca),
        ("ssl.certificate.location", Kind::Cert),
        ("ssl.key.location", Kind::Key),
        ("ssl.keystore.location", Kind::Other),
        ("ssl.crl.location", Kind::Other),
    ] {
        match config.kafka.properties.get(property) {
            // librdkafka's `probe` means the system's CA bundle, not a file.
            Some(value) if !(property == "ssl.ca.location" && value == "probe") => {
                others.push(Named {
                    field: format!("kafka.properties.\"{property}\""),
                    path: PathBuf::from(value),
                    kind,
                });
            }
            _ => {}
        }
    }
    if !others.is_empty() {
        groups.push((others, None));
    }
    groups
}

/// One line per TLS file, and after a listener's files whether its key and certificate pair up.
pub(super) fn check(config: &Config) -> Vec<Line> {
    let groups = named(config);
    if groups.is_empty() {
        return vec![Line::skipped(
            "tls",
            "the config names no TLS file ([enforcer.tls], [pipeline.sql_tls], webhook_tls, \
             sslrootcert, kafka ssl.*.location)",
        )];
    }
    let now = wall_now();
    let mut lines = Vec::new();
    for (files, listener) in groups {
        let first = lines.len();
        lines.extend(files.iter().map(|f| file_line(f, now)));
        let Some((section, tls)) = listener else {
            continue;
        };
        // Only where its files read: their own lines say what is wrong otherwise.
        if lines[first..]
            .iter()
            .any(|l| l.text.starts_with("cannot read"))
        {
            continue;
        }
        lines.push(match ServerTls::load(&tls, &section, "doctor", &[]) {
            Ok(_) => Line::ok(
                format!("tls {section}"),
                format!(
                    "the key in {} is the certificate's in {}; the listener loads them",
                    tls.key.display(),
                    tls.cert.display()
                ),
            ),
            Err(e) => Line::fail(
                format!("tls {section}"),
                e.to_string(),
                format!("give {section} a certificate and the key it was issued for"),
            ),
        });
    }
    lines
}

fn file_line(file: &Named, now: SystemTime) -> Line {
    let check = format!("tls {}", file.field);
    let path = file.path.display();
    let bytes = match std::fs::read(&file.path) {
        Ok(bytes) => bytes,
        Err(e) => {
            return Line::fail(
                check,
                format!("cannot read {path}: {e}"),
                format!(
                    "put the file there, readable by the account gpuwarden runs as, or correct {}",
                    file.field
                ),
            )
        }
    };
    match file.kind {
        Kind::Other => Line::ok(check, format!("{path} is readable")),
        Kind::Key => {
            let text = String::from_utf8_lossy(&bytes);
            if text.contains("PRIVATE KEY-----") {
                Line::ok(check, format!("{path} is readable and holds a private key"))
            } else {
                Line::fail(
                    check,
                    format!("{path} holds no PEM private key"),
                    format!("point {} at the PEM file of the private key", file.field),
                )
            }
        }
        Kind::Cert | Kind::Ca => certificates_line(check, file, &bytes, now),
    }
}

/// A certificate file's line: the certificate in it that expires first, against
/// [`EXPIRY_MARGIN`].
fn certificates_line(check: String, file: &Named, pem: &[u8], now: SystemTime) -> Line {
    let path = file.path.display();
    let ders: Result<Vec<CertificateDer<'_>>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let ders = match ders {
        Ok(ders) if !ders.is_empty() => ders,
        Ok(_) => {
            return Line::fail(
                check,
                format!("{path} holds no PEM certificate"),
                format!("point {} at a PEM file of certificates", file.field),
            )
        }
        Err(e) => {
            return Line::fail(
                check,
                format!("{path} is not PEM: {e}"),
                format!("point {} at a PEM file of certificates", file.field),
            )
        }
    };
    let mut first: Option<(SystemTime, String)> = None;
    for der in &ders {
        let cert = match x509_cert::Certificate::from_der(der.as_ref()) {
            Ok(cert) => cert,
            Err(e) => {
                return Line::fail(
                    check,
                    format!("{path} holds a certificate that does not parse: {e}"),
                    format!("point {} at valid X.509 certificates", file.field),
                )
            }
        };
        let not_after = UNIX_EPOCH + cert.tbs_certificate.validity.not_after.to_unix_duration();
        let subject = cert.tbs_certificate.subject.to_string();
        if first.as_ref().is_none_or(|(t, _)| not_after < *t) {
            first = Some((not_after, subject));
        }
    }
    let (not_after, subject) = first.expect("at least one certificate");
    let when = humantime::format_rfc3339_seconds(not_after);
    let what = if ders.len() == 1 {
        subject
    } else {
        format!(
            "{subject}, the first of its {} certificates to expire,",
            ders.len()
        )
    };
    let renew = match file.kind {
        Kind::Ca => "replace it with the CA's renewed certificate".to_string(),
        _ => "renew it (the API, SQL and webhook listeners read a renewed file without a restart)"
            .to_string(),
    };
    match not_after.duration_since(now) {
        Err(past) => Line::fail(
            check,
            format!(
                "{path}: {what} expired on {when}, {} ago",
                span(past.duration())
            ),
            renew,
        ),
        Ok(left) if left < EXPIRY_MARGIN => Line::fail(
            check,
            format!("{path}: {what} expires on {when}, in {}", span(left)),
            renew,
        ),
        Ok(left) => Line::ok(
            check,
            format!(
                "{path}: {what} valid until {when} ({} from now)",
                span(left)
            ),
        ),
    }
}
