//! TLS for gpuwarden's listeners (the admission API, the SQL endpoint) and for the command line's
//! calls to the API: PEM files in, a `rustls` configuration out, with the `ring` provider only.
//!
//! It lives here, behind the `tls` feature, because the binary (which serves the API) and the
//! pipeline (which serves SQL) both need it and never import each other. A listener's
//! certificate is served through [`ServerTls`], whose resolver a thread keeps current: every
//! [`RELOAD_EVERY`] it reads the certificate and key files again and, when their content changed
//! and the new pair is valid, swaps it in for the next handshakes, so a renewal (certbot,
//! cert-manager) needs no restart. A new pair that does not load keeps the old certificate,
//! logs an error naming the file, and is counted in `gpuwarden_tls_reloads_total{result="error"}`.
//! Errors name the config field and the file at fault.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::config::{ClientAuth, TlsConfig};
use crate::prom;

/// How often the certificate and key files are read again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// Why TLS could not be set up. Each message names the config field (or flag) and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{field}: cannot read {}: {source}", path.display())]
    Read {
        /// The config field or flag that names the file.
        field: String,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is not the PEM it should be, or holds nothing of what it should.
    #[error("{field}: {}: {reason}", path.display())]
    Pem {
        /// The config field or flag that names the file.
        field: String,
        /// The file.
        path: PathBuf,
        /// What is wrong with it, for a person.
        reason: String,
    },
    /// The private key does not belong to the certificate.
    #[error(
        "{field}: the private key in {} does not belong to the certificate in {}",
        key.display(),
        cert.display()
    )]
    Mismatch {
        /// The config field that names the key.
        field: String,
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
    },
    /// rustls refused the settings (an internal error: the files were fine).
    #[error("{field}: setting up TLS: {source}")]
    Rustls {
        /// The config section.
        field: String,
        /// rustls's reason.
        #[source]
        source: rustls::Error,
    },
    /// The thread that reloads the certificate could not be started.
    #[error("{field}: starting the certificate reload thread: {source}")]
    Thread {
        /// The config section.
        field: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The one crypto provider gpuwarden uses: ring, pure Rust apart from ring's own assembly.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring ([`provider`]) the process's default rustls provider, for the libraries that
/// build a TLS configuration without naming one (kube's client): with both ring and aws-lc-rs
/// compiled in (aws-lc comes with the Delta Lake engine's HTTP client, `deltalake-core`), rustls
/// cannot choose one itself and panics at the first such configuration. Idempotent: a default
/// already installed stays.
pub fn install_default_provider() {
    let _ = CryptoProvider::install_default(rustls::crypto::ring::default_provider());
}

/// A listener's TLS: the `rustls` server configuration to accept with, and the counts of its
/// certificate reloads. Dropping every clone of it and of [`ServerTls::config`] stops the reload
/// thread.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    resolver: Arc<Reloading>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.resolver.files.cert)
            .field("key", &self.resolver.files.key)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads `tls` (the section at `section`, e.g. `"enforcer.tls"`, which errors name) for the
    /// listener `listener` (`"api"` or `"sql"`, the metrics label), offering `alpn` protocols.
    /// Starts the thread that reloads the certificate.
    pub fn load(
        tls: &TlsConfig,
        section: &str,
        listener: &'static str,
        alpn: &[&[u8]],
    ) -> Result<Self, TlsError> {
        let provider = provider();
        let files = Files {
            cert: tls.cert.clone(),
            key: tls.key.clone(),
            section: section.to_string(),
        };
        let (cert_pem, key_pem) = files.read()?;
        let first = files.certified(&cert_pem, &key_pem, &provider)?;
        let resolver = Arc::new(Reloading {
            current: RwLock::new(Arc::new(first)),
            pending: Mutex::new(Pending {
                loaded: Some((cert_pem, key_pem)),
                refused: None,
            }),
            files,
            listener,
            provider: Arc::clone(&provider),
            reloaded: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        });
        let rustls_error = |source| TlsError::Rustls {
            field: section.to_string(),
            source,
        };
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?;
        let builder = match &tls.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let field = format!("{section}.client_ca");
                let roots = Arc::new(roots(ca, &field)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider);
                let verifier = match tls.client_auth.unwrap_or(ClientAuth::Required) {
                    ClientAuth::Required => verifier,
                    ClientAuth::Optional => verifier.allow_unauthenticated(),
                };
                let verifier = verifier.build().map_err(|e| TlsError::Pem {
                    field,
                    path: ca.clone(),
                    reason: format!("cannot check client certificates against it: {e}"),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(Arc::clone(&resolver) as _);
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let config = Arc::new(config);
        let watched = Arc::downgrade(&resolver);
        std::thread::Builder::new()
            .name(format!("gpuwarden-tls-{listener}"))
            .spawn(move || reload_loop(&watched))
            .map_err(|source| TlsError::Thread {
                field: section.to_string(),
                source,
            })?;
        Ok(Self { config, resolver })
    }

    /// The configuration to accept connections with (for tokio-rustls's `TlsAcceptor`).
    pub fn config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.config)
    }

    /// Reads the files again now, as the reload thread does every [`RELOAD_EVERY`]; whether a
    /// new certificate was swapped in.
    pub fn reload(&self) -> bool {
        self.resolver.reload()
    }

    /// Appends this listener's reload counts to a `/metrics` page.
    pub fn render_metrics(&self, out: &mut String) {
        render_reloads(out, &[self]);
    }
}

/// Writes `gpuwarden_tls_reloads_total{listener, result}` for `listeners`.
pub fn render_reloads(out: &mut String, listeners: &[&ServerTls]) {
    let labels: Vec<(String, f64)> = listeners
        .iter()
        .flat_map(|tls| {
            let r = &tls.resolver;
            [
                (
                    format!("listener=\"{}\",result=\"ok\"", r.listener),
                    r.reloaded.load(Ordering::Relaxed) as f64,
                ),
                (
                    format!("listener=\"{}\",result=\"error\"", r.listener),
                    r.failed.load(Ordering::Relaxed) as f64,
                ),
            ]
        })
        .collect();
    prom::family(
        out,
        "gpuwarden_tls_reloads_total",
        "counter",
        "Changes of a listener's certificate or key files: swapped in (ok) or refused, the old certificate kept (error).",
        labels.iter().map(|(l, v)| (l.as_str(), *v)),
    );
}

/// The files of one listener, and the config section that names them.
#[derive(Debug)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
    section: String,
}

impl Files {
    fn read(&self) -> Result<Pair, TlsError> {
        let read = |path: &Path, name: &str| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                field: format!("{}.{name}", self.section),
                path: path.to_path_buf(),
                source,
            })
        };
        Ok((read(&self.cert, "cert")?, read(&self.key, "key")?))
    }

    fn certified(
        &self,
        cert_pem: &[u8],
        key_pem: &[u8],
        provider: &CryptoProvider,
    ) -> Result<CertifiedKey, TlsError> {
        let cert_field = format!("{}.cert", self.section);
        let key_field = format!("{}.key", self.section);
        let chain = certificates(cert_pem, &self.cert, &cert_field)?;
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Pem {
            field: key_field.clone(),
            path: self.key.clone(),
            reason: match e {
                rustls::pki_types::pem::Error::NoItemsFound => {
                    "holds no private key (PEM `-----BEGIN PRIVATE KEY-----`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`)".to_string()
                }
                other => format!("is not a PEM private key: {other}"),
            },
        })?;
        let signing = provider
            .key_provider
            .load_private_key(key)
            .map_err(|e| TlsError::Pem {
                field: key_field.clone(),
                path: self.key.clone(),
                reason: format!("the private key cannot be used: {e}"),
            })?;
        let certified = CertifiedKey::new(chain, signing);
        match certified.keys_match() {
            Ok(()) => Ok(certified),
            // A key whose public half rustls cannot tell is let through: the handshake fails
            // loudly enough if it does not fit.
            Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
                Ok(certified)
            }
            Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
                Err(TlsError::Mismatch {
                    field: key_field,
                    cert: self.cert.clone(),
                    key: self.key.clone(),
                })
            }
            Err(e) => Err(TlsError::Pem {
                field: cert_field,
                path: self.cert.clone(),
                reason: format!("is not a valid certificate: {e}"),
            }),
        }
    }
}

fn certificates(
    pem: &[u8],
    path: &Path,
    field: &str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let error = |reason: String| TlsError::Pem {
        field: field.to_string(),
        path: path.to_path_buf(),
        reason,
    };
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(format!("is not valid PEM: {e}")))?;
    if chain.is_empty() {
        return Err(error(
            "holds no certificate (PEM `-----BEGIN CERTIFICATE-----`)".to_string(),
        ));
    }
    Ok(chain)
}

/// The CA certificates in the PEM file at `path`, named by `field` in errors.
pub fn roots(path: &Path, field: &str) -> Result<RootCertStore, TlsError> {
    let pem = std::fs::read(path).map_err(|source| TlsError::Read {
        field: field.to_string(),
        path: path.to_path_buf(),
        source,
    })?;
    let mut roots = RootCertStore::empty();
    for cert in certificates(&pem, path, field)? {
        roots.add(cert).map_err(|e| TlsError::Pem {
            field: field.to_string(),
            path: path.to_path_buf(),
            reason: format!("holds a certificate that cannot be a trust anchor: {e}"),
        })?;
    }
    Ok(roots)
}

/// A client's TLS settings for calling a gpuwarden listener: trusting the CAs in `ca` (and
/// nothing else), showing the certificate and key of `identity` when given. `fields` names the
/// flags in errors: (CA, certificate, key).
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    fields: (&str, &str, &str),
) -> Result<ClientConfig, TlsError> {
    let roots = roots(ca, fields.0)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            field: fields.0.to_string(),
            source,
        })?
        .with_root_certificates(roots);
    let Some((cert, key)) = identity else {
        return Ok(builder.with_no_client_auth());
    };
    let read = |path: &Path, field: &str| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            field: field.to_string(),
            path: path.to_path_buf(),
            source,
        })
    };
    let chain = certificates(&read(cert, fields.1)?, cert, fields.1)?;
    let private =
        PrivateKeyDer::from_pem_slice(&read(key, fields.2)?).map_err(|e| TlsError::Pem {
            field: fields.2.to_string(),
            path: key.to_path_buf(),
            reason: format!("is not a PEM private key: {e}"),
        })?;
    builder
        .with_client_auth_cert(chain, private)
        .map_err(|_| TlsError::Mismatch {
            field: fields.2.to_string(),
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        })
}

/// The certificate resolver that serves the newest valid pair of files.
#[derive(Debug)]
struct Reloading {
    current: RwLock<Arc<CertifiedKey>>,
    pending: Mutex<Pending>,
    files: Files,
    listener: &'static str,
    provider: Arc<CryptoProvider>,
    reloaded: AtomicU64,
    failed: AtomicU64,
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(
            &self.current.read().unwrap_or_else(|e| e.into_inner()),
        ))
    }
}

/// The content of the certificate file and of the key file.
type Pair = (Vec<u8>, Vec<u8>);

/// What the reload loop remembers between rounds.
#[derive(Debug)]
struct Pending {
    /// The files' content when they last loaded, so that an unchanged pair is not parsed again.
    loaded: Option<Pair>,
    /// A changed pair that did not load, and whether it was reported: renewals write the two
    /// files one after the other, so a pair is reported only when it is still the same a round
    /// later.
    refused: Option<(Pair, bool)>,
}

impl Reloading {
    /// One round: reads the files; swaps in a changed pair that loads. Whether it swapped.
    fn reload(&self) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let pending = &mut *pending;
        let pair = match self.files.read() {
            Ok(pair) => pair,
            Err(e) => {
                // A file being replaced may be missing for a moment: report it the second time.
                self.refuse(pending, (Vec::new(), Vec::new()), &e);
                return false;
            }
        };
        if pending.loaded.as_ref() == Some(&pair) {
            pending.refused = None;
            return false;
        }
        match self.files.certified(&pair.0, &pair.1, &self.provider) {
            Ok(certified) => {
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(certified);
                self.reloaded.fetch_add(1, Ordering::Relaxed);
                tracing::info!(listener = self.listener, cert = %self.files.cert.display(), key = %self.files.key.display(), "TLS certificate reloaded");
                pending.loaded = Some(pair);
                pending.refused = None;
                true
            }
            Err(e) => {
                self.refuse(pending, pair, &e);
                false
            }
        }
    }

    fn refuse(&self, pending: &mut Pending, pair: Pair, error: &TlsError) {
        match &mut pending.refused {
            Some((seen, reported)) if *seen == pair => {
                if !*reported {
                    *reported = true;
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(listener = self.listener, error = %error, "the new TLS certificate or key does not load; still serving the previous certificate");
                }
            }
            _ => pending.refused = Some((pair, false)),
        }
    }
}

fn reload_loop(watched: &Weak<Reloading>) {
    loop {
        std::thread::sleep(RELOAD_EVERY);
        let Some(resolver) = watched.upgrade() else {
            return;
        };
        resolver.reload();
    }
}
