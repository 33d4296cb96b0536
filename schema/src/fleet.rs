//! The inventory of a `simulated` substrate, derived from the config alone.
//!
//! The collector's simulated fleet and the enforcer's `simulated` driver never import each other,
//! yet must agree on every host name and GPU UUID: both call [`simulated_inventory`], which
//! depends on nothing but the substrate's config (not on the simulation's seed).

use crate::config::{DriverKind, SubstrateConfig};

/// One GPU of a simulated fleet, as NVML on its host would report it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InventoryGpu {
    /// The substrate it belongs to.
    pub substrate: String,
    /// Host name: `<prefix>-<n>`, n from 0.
    pub host: String,
    /// NVML index on its host.
    pub index: u32,
    /// Stable UUID in NVML's `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` form.
    pub uuid: String,
    /// Full NVML model name.
    pub model: String,
    /// PCI bus id in NVML's `DDDDDDDD:BB:DD.F` form.
    pub pci_bus_id: String,
}

/// Every GPU of a `simulated` substrate, host by host in config order; empty for other drivers.
pub fn simulated_inventory(substrate: &SubstrateConfig) -> Vec<InventoryGpu> {
    if substrate.driver != DriverKind::Simulated {
        return Vec::new();
    }
    let mut gpus = Vec::new();
    for group in &substrate.hosts {
        for n in 0..group.count {
            let host = format!("{}-{n}", group.prefix);
            for index in 0..group.gpus {
                gpus.push(InventoryGpu {
                    substrate: substrate.name.clone(),
                    uuid: uuid_for(&substrate.name, &host, index),
                    pci_bus_id: format!("00000000:{:02X}:00.0", 0x17 + index * 0x10 % 0xE0),
                    host: host.clone(),
                    index,
                    model: group.gpu_model.clone(),
                });
            }
        }
    }
    gpus
}

/// A UUID that depends only on where the GPU is, so every process derives the same one.
fn uuid_for(substrate: &str, host: &str, index: u32) -> String {
    let a = fnv1a(format!("{substrate}/{host}/{index}/a").as_bytes());
    let b = fnv1a(format!("{substrate}/{host}/{index}/b").as_bytes());
    let hex = format!("{a:016x}{b:016x}");
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    #[test]
    fn inventory_is_derived_from_the_config_alone() {
        let text = r#"
[[substrates]]
name = "sim"
driver = "simulated"
hosts = [
  { prefix = "h100", count = 2, gpus = 8, gpu_model = "NVIDIA H100 80GB HBM3" },
  { prefix = "t4", count = 1, gpus = 4, gpu_model = "Tesla T4" },
]
"#;
        let config = config::parse("t.toml", text).unwrap();
        let gpus = simulated_inventory(&config.substrates[0]);
        assert_eq!(gpus.len(), 20);
        assert_eq!(gpus[0].host, "h100-0");
        assert_eq!(gpus[8].host, "h100-1");
        assert_eq!(gpus[19].host, "t4-0");
        assert_eq!(gpus[19].index, 3);
        assert_eq!(gpus[19].model, "Tesla T4");
        let uuids: std::collections::BTreeSet<_> = gpus.iter().map(|g| g.uuid.clone()).collect();
        assert_eq!(uuids.len(), 20, "UUIDs are unique");
        assert!(gpus
            .iter()
            .all(|g| g.uuid.len() == 40 && g.uuid.starts_with("GPU-")));
        assert_eq!(
            simulated_inventory(&config.substrates[0]),
            gpus,
            "same config, same inventory"
        );
        let pci: std::collections::BTreeSet<_> =
            gpus[..8].iter().map(|g| g.pci_bus_id.clone()).collect();
        assert_eq!(pci.len(), 8, "bus ids are unique on a host");
    }
}
