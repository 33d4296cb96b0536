//! The listeners' TLS in process: certificates made by the openssl command line, handshakes
//! between a rustls client and the server configuration under test over in-memory buffers.
//! What is served, what a reload swaps in or keeps out, and how errors name the field and file.

#[path = "../../tests/support/pki.rs"]
mod pki;

use std::path::Path;
use std::sync::Arc;

use gpuwarden_schema::config::{ClientAuth, TlsConfig};
use gpuwarden_schema::tls::{client_config, ServerTls};
use pki::{Ca, Leaf};
use rustls::pki_types::ServerName;
use rustls::{ClientConnection, ServerConfig, ServerConnection};

/// A full handshake of a client trusting `ca` (showing `identity`) with `server`; the
/// certificate the server presented, or the side and reason it failed.
fn handshake(
    server: Arc<ServerConfig>,
    ca: &Path,
    identity: Option<&Leaf>,
) -> Result<Vec<u8>, String> {
    let config = client_config(
        ca,
        identity.map(|l| (l.cert.as_path(), l.key.as_path())),
        ("ca", "cert", "key"),
    )
    .map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut client = ClientConnection::new(Arc::new(config), name).unwrap();
    let mut server = ServerConnection::new(server).unwrap();
    for _ in 0..20 {
        let mut bytes = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut bytes).unwrap();
        }
        if !bytes.is_empty() {
            server.read_tls(&mut bytes.as_slice()).unwrap();
            server
                .process_new_packets()
                .map_err(|e| format!("server: {e}"))?;
        }
        let mut bytes = Vec::new();
        while server.wants_write() {
            server.write_tls(&mut bytes).unwrap();
        }
        if !bytes.is_empty() {
            client.read_tls(&mut bytes.as_slice()).unwrap();
            client
                .process_new_packets()
                .map_err(|e| format!("client: {e}"))?;
        }
        if !client.is_handshaking() && !server.is_handshaking() {
            let presented = client.peer_certificates().expect("the server's chain");
            return Ok(presented[0].to_vec());
        }
    }
    Err("the handshake did not finish".into())
}

fn settings(dir: &Path, client_ca: Option<&Path>) -> TlsConfig {
    TlsConfig {
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
        client_ca: client_ca.map(Path::to_path_buf),
        client_auth: client_ca.map(|_| ClientAuth::Required),
    }
}

fn reloads(tls: &ServerTls) -> String {
    let mut page = String::new();
    tls.render_metrics(&mut page);
    page
}

#[test]
fn serves_its_certificate_and_swaps_in_a_renewed_one() {
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (Ca::new(dir.path(), "first"), Ca::new(dir.path(), "second"));
    let (old, new) = (first.server("api"), second.server("api"));
    let settings = settings(dir.path(), None);
    old.install(&settings.cert, &settings.key);
    let tls = ServerTls::load(&settings, "enforcer.tls", "api", &[b"http/1.1"]).unwrap();
    assert_eq!(handshake(tls.config(), &first.cert, None), Ok(old.der()));
    assert!(handshake(tls.config(), &second.cert, None)
        .unwrap_err()
        .contains("UnknownIssuer"));

    assert!(!tls.reload(), "nothing changed, nothing to swap");
    new.install(&settings.cert, &settings.key);
    assert!(tls.reload());
    assert_eq!(handshake(tls.config(), &second.cert, None), Ok(new.der()));
    assert!(handshake(tls.config(), &first.cert, None).is_err());
    let page = reloads(&tls);
    assert!(
        page.contains("gpuwarden_tls_reloads_total{listener=\"api\",result=\"ok\"} 1\n")
            && page.contains("gpuwarden_tls_reloads_total{listener=\"api\",result=\"error\"} 0\n"),
        "{page}"
    );
}

#[test]
fn a_new_pair_that_does_not_load_keeps_the_old_certificate_and_is_counted_once() {
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (Ca::new(dir.path(), "first"), Ca::new(dir.path(), "second"));
    let (old, new) = (first.server("sql"), second.server("sql"));
    let settings = settings(dir.path(), None);
    old.install(&settings.cert, &settings.key);
    let tls = ServerTls::load(&settings, "pipeline.sql_tls", "sql", &[]).unwrap();
    let errors =
        |n: u32| format!("gpuwarden_tls_reloads_total{{listener=\"sql\",result=\"error\"}} {n}\n");

    // A half-written certificate: reported once it stays so for a round (the reload thread may
    // have taken one of these rounds), and only once.
    std::fs::write(&settings.cert, "-----BEGIN CERTIFICATE-----\nMIIB").unwrap();
    for _ in 0..3 {
        assert!(!tls.reload());
    }
    assert!(reloads(&tls).contains(&errors(1)), "{}", reloads(&tls));
    assert_eq!(handshake(tls.config(), &first.cert, None), Ok(old.der()));

    // The new certificate with the old key: refused as well, the old pair still served.
    std::fs::copy(&new.cert, &settings.cert).unwrap();
    for _ in 0..3 {
        assert!(!tls.reload());
    }
    assert!(reloads(&tls).contains(&errors(2)), "{}", reloads(&tls));
    assert_eq!(handshake(tls.config(), &first.cert, None), Ok(old.der()));

    // Its key arrives: swapped in.
    std::fs::copy(&new.key, &settings.key).unwrap();
    assert!(tls.reload());
    assert_eq!(handshake(tls.config(), &second.cert, None), Ok(new.der()));
}

#[test]
fn errors_name_the_field_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (one, two) = (ca.server("one"), ca.server("two"));
    let settings = settings(dir.path(), None);
    let load = |s: &TlsConfig| {
        ServerTls::load(s, "enforcer.tls", "api", &[])
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let cert = settings.cert.display().to_string();
    let key = settings.key.display().to_string();

    let missing = load(&settings);
    assert!(
        missing.starts_with(&format!("enforcer.tls.cert: cannot read {cert}: ")),
        "{missing}"
    );

    std::fs::copy(&one.cert, &settings.cert).unwrap();
    std::fs::copy(&two.key, &settings.key).unwrap();
    assert_eq!(
        load(&settings),
        format!("enforcer.tls.key: the private key in {key} does not belong to the certificate in {cert}")
    );

    std::fs::copy(&one.cert, &settings.key).unwrap();
    let not_a_key = load(&settings);
    assert!(
        not_a_key.starts_with(&format!("enforcer.tls.key: {key}: holds no private key")),
        "{not_a_key}"
    );

    std::fs::copy(&one.key, &settings.key).unwrap();
    std::fs::copy(&one.key, &settings.cert).unwrap();
    let not_a_cert = load(&settings);
    assert!(
        not_a_cert.starts_with(&format!("enforcer.tls.cert: {cert}: holds no certificate")),
        "{not_a_cert}"
    );

    std::fs::copy(&one.cert, &settings.cert).unwrap();
    let absent_ca = dir.path().join("clients.pem");
    let with_ca = self::settings(dir.path(), Some(&absent_ca));
    let no_ca = load(&with_ca);
    assert!(
        no_ca.starts_with(&format!(
            "enforcer.tls.client_ca: cannot read {}",
            absent_ca.display()
        )),
        "{no_ca}"
    );
}

#[test]
fn client_certificates_are_checked_against_client_ca_when_required() {
    let dir = tempfile::tempdir().unwrap();
    let (servers, clients, strangers) = (
        Ca::new(dir.path(), "servers"),
        Ca::new(dir.path(), "clients"),
        Ca::new(dir.path(), "strangers"),
    );
    let settings = settings(dir.path(), Some(&clients.cert));
    servers.server("api").install(&settings.cert, &settings.key);
    let required = ServerTls::load(&settings, "enforcer.tls", "api", &[]).unwrap();
    let (member, stranger) = (clients.client("ada"), strangers.client("eve"));

    assert!(handshake(required.config(), &servers.cert, Some(&member)).is_ok());
    let none = handshake(required.config(), &servers.cert, None).unwrap_err();
    assert!(
        none.starts_with("server: ") && none.contains("peer sent no certificates"),
        "{none}"
    );
    let foreign = handshake(required.config(), &servers.cert, Some(&stranger)).unwrap_err();
    assert!(
        foreign.starts_with("server: ") && foreign.contains("UnknownIssuer"),
        "{foreign}"
    );

    let optional = TlsConfig {
        client_auth: Some(ClientAuth::Optional),
        ..settings
    };
    let optional = ServerTls::load(&optional, "enforcer.tls", "api", &[]).unwrap();
    assert!(handshake(optional.config(), &servers.cert, None).is_ok());
    assert!(handshake(optional.config(), &servers.cert, Some(&member)).is_ok());
    assert!(handshake(optional.config(), &servers.cert, Some(&stranger)).is_err());
}
