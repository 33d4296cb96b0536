//! The substrates: each `[[substrates]]` entry's driver, built as the enforcer builds it and
//! asked what the enforcer asks it first, its inventory. That is each driver's own probe of its
//! substrate: Slurm's runs `squeue --json`, `sinfo --json` and `scontrol show partition` (the
//! driver speaks to Slurm through its commands and munge, never slurmrestd); Kubernetes' lists the
//! nodes through the API server; libvirt's connects to its URI and lists the host's node devices;
//! local's and simulated's come from the config. Besides: a webhook's URL must accept a TCP
//! connection (the driver calls it only to provision and reclaim, with a signed body doctor will
//! not send), and local and slurm resolve the system account of every user their `accounts`
//! table names, as admission would.
//!
//! The drivers keep their state in doctor's scratch directory, not the installation's, and the
//! Kubernetes driver writes down its pods in a scratch store: doctor adopts, reclaims and
//! records nothing.

use std::path::Path;
use std::time::Duration;

use gpuwarden_enforcer::drivers::{self, DriverContext, Inventory};
use gpuwarden_schema::config::{DriverKind, SubstrateConfig};

use super::Line;

/// What to look at when `substrate`'s probe does not answer in time.
pub(super) fn timeout_fix(substrate: &SubstrateConfig) -> String {
    match substrate.driver {
        DriverKind::Slurm => "check that slurmctld answers (scontrol ping) and munged runs on this host".into(),
        DriverKind::Kubernetes => "check that the API server of the kubeconfig (or the in-cluster service) is reachable from this host".into(),
        DriverKind::Libvirt => "check that libvirtd (or virtqemud) answers at the substrate's uri (virsh -c URI version)".into(),
        DriverKind::Webhook => "check that the provisioner at the substrate's url is up and reachable from this host".into(),
        DriverKind::Local | DriverKind::Simulated => "check the machine's user database (NSS: LDAP, SSSD), which the account lookups ask".into(),
    }
}

/// `substrate`'s line, its driver's state under `scratch`, within `budget`.
pub(super) fn check(substrate: &SubstrateConfig, scratch: &Path, budget: Duration) -> Line {
    let name = format!("substrate {}", substrate.name);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            return Line::fail(
                name,
                format!("cannot start a runtime: {e}"),
                "look at the machine's limits",
            )
        }
    };
    // The deadline drops the probe, and with it a Slurm command still running (the driver's
    // commands are killed when dropped).
    match runtime.block_on(async { tokio::time::timeout(budget, probe(substrate, scratch)).await })
    {
        Ok(Ok(text)) => Line::ok(name, text),
        Ok(Err((text, fix))) => Line::fail(name, text, fix),
        Err(_) => Line::fail(
            name,
            format!(
                "substrate {} ({}) did not answer within {}",
                substrate.name,
                substrate.driver.as_str(),
                humantime::format_duration(budget)
            ),
            timeout_fix(substrate),
        ),
    }
}

async fn probe(substrate: &SubstrateConfig, scratch: &Path) -> Result<String, (String, String)> {
    let kind = substrate.driver.as_str();
    let store = match substrate.driver {
        DriverKind::Kubernetes => {
            std::fs::create_dir_all(scratch).map_err(|e| {
                (
                    format!("cannot make {}: {e}", scratch.display()),
                    "check the temporary directory (TMPDIR)".to_string(),
                )
            })?;
            let path = scratch.join("store.db");
            let store =
                tokio::task::spawn_blocking(move || gpuwarden_enforcer::store::Store::open(&path))
                    .await
                    .map_err(|e| (e.to_string(), "report it".to_string()))?
                    .map_err(|e| {
                        (
                            format!("a scratch lease store: {e}"),
                            "check TMPDIR".to_string(),
                        )
                    })?;
            Some(store)
        }
        _ => None,
    };
    let context = DriverContext {
        state_dir: scratch.to_path_buf(),
        lease_refs: store.map(gpuwarden_enforcer::service::lease_refs),
    };
    let settings_fix = format!(
        "correct [[substrates]] {} (`gpuwarden check-config` checks the rest)",
        substrate.name
    );
    let built = {
        let substrate = substrate.clone();
        tokio::task::spawn_blocking(move || drivers::build(&substrate, &context))
            .await
            .map_err(|e| (e.to_string(), "report it".to_string()))?
    };
    let driver = built.map_err(|e| (e.to_string(), settings_fix.clone()))?;
    let inventory = driver
        .inventory()
        .await
        .map_err(|e| (e.to_string(), timeout_fix(substrate)))?;
    let mut said = format!("{kind}: {}", describe(&inventory));
    if matches!(substrate.driver, DriverKind::Local | DriverKind::Slurm) {
        for (user, account) in &substrate.accounts {
            if let Some(refusal) = driver.refusal(user).await {
                return Err((
                    format!(
                        "user {user} maps to system account {account}, which the driver refuses: {}",
                        refusal.message
                    ),
                    format!(
                        "create the account {account} (uid at least min_uid, in no denied group), \
                         or correct [[substrates]] {} accounts",
                        substrate.name
                    ),
                ));
            }
        }
        if !substrate.accounts.is_empty() {
            said.push_str(&match substrate.accounts.len() {
                1 => "; the account in `accounts` resolves".to_string(),
                n => format!("; the {n} accounts in `accounts` resolve"),
            });
        }
    }
    if substrate.driver == DriverKind::Webhook {
        let url = substrate.url.as_deref().unwrap_or_default();
        let address = webhook_address(url)
            .ok_or_else(|| (format!("url {url} names no host"), settings_fix.clone()))?;
        tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|e| {
                (
                    format!("{address} (its url's host) refuses a connection: {e}"),
                    timeout_fix(substrate),
                )
            })?;
        said.push_str(&format!("; {address} accepts connections"));
    }
    Ok(said)
}

/// `host:port` of a webhook URL (the scheme's port when it names none).
fn webhook_address(url: &str) -> Option<String> {
    let uri: hyper::Uri = url.parse().ok()?;
    let host = uri.host()?;
    let port = uri
        .port_u16()
        .unwrap_or(if uri.scheme_str() == Some("http") {
            80
        } else {
            443
        });
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some(if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

/// An inventory in a few words: `4 GPUs named (NVIDIA H100 ×4)`, `pooled: NVIDIA H100 ×16`.
fn describe(inventory: &Inventory) -> String {
    let mut parts = Vec::new();
    if !inventory.gpus.is_empty() {
        let mut models: std::collections::BTreeMap<&str, usize> = Default::default();
        for gpu in &inventory.gpus {
            *models.entry(gpu.model.as_str()).or_default() += 1;
        }
        let models: Vec<String> = models.iter().map(|(m, n)| format!("{n} × {m}")).collect();
        parts.push(format!(
            "{} GPU{} named ({})",
            inventory.gpus.len(),
            if inventory.gpus.len() == 1 { "" } else { "s" },
            models.join(", ")
        ));
    }
    if !inventory.pooled.is_empty() {
        let pooled: Vec<String> = inventory
            .pooled
            .iter()
            .map(|(model, n)| format!("{n} × {model}"))
            .collect();
        parts.push(format!("pooled {}", pooled.join(", ")));
    }
    if parts.is_empty() {
        "answered, with no GPUs".into()
    } else {
        format!("answered: {}", parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_webhook_address_takes_its_schemes_port() {
        assert_eq!(
            webhook_address("https://prov.example.com/hook").as_deref(),
            Some("prov.example.com:443")
        );
        assert_eq!(
            webhook_address("http://127.0.0.1:8090/x").as_deref(),
            Some("127.0.0.1:8090")
        );
        assert_eq!(
            webhook_address("http://[::1]/x").as_deref(),
            Some("[::1]:80")
        );
    }
}
