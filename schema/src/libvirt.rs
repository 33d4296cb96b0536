//! Names the libvirt driver and the collector share: PCI addresses and device ids as libvirt
//! writes them, mediated device UUIDs, and the SMBIOS OEM string that carries a virtual
//! machine's lease into its guest.

use std::fmt;

/// The prefix of the SMBIOS OEM string (type 11) that names a virtual machine's lease:
/// `gpuwarden.lease_id=<lease id>`. The libvirt driver writes it into each domain's
/// `<sysinfo type='smbios'><oemStrings>`; the collector in the guest reads it from
/// `/sys/firmware/dmi/entries/11-*/raw`.
pub const OEM_LEASE_PREFIX: &str = "gpuwarden.lease_id=";

/// A PCI function's address, `domain:bus:slot.function` (`0000:41:00.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// PCI domain (segment), 16 bits.
    pub domain: u16,
    /// Bus, 8 bits.
    pub bus: u8,
    /// Slot (device), 5 bits.
    pub slot: u8,
    /// Function, 3 bits.
    pub function: u8,
}

impl PciAddress {
    /// Reads `0000:41:00.0` (hex; the domain may be left out, `41:00.0`, meaning 0).
    pub fn parse(s: &str) -> Option<Self> {
        let (rest, function) = s.rsplit_once('.')?;
        let mut parts = rest.rsplitn(3, ':');
        let slot = parts.next()?;
        let bus = parts.next()?;
        let domain = parts.next().unwrap_or("0");
        let hex = |s: &str, max_len: usize| {
            (!s.is_empty() && s.len() <= max_len && s.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| u32::from_str_radix(s, 16).ok())
                .flatten()
        };
        let address = Self {
            domain: u16::try_from(hex(domain, 4)?).ok()?,
            bus: u8::try_from(hex(bus, 2)?).ok()?,
            slot: u8::try_from(hex(slot, 2)?).ok()?,
            function: u8::try_from(hex(function, 1)?).ok()?,
        };
        (address.slot < 32 && address.function < 8).then_some(address)
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.slot, self.function
        )
    }
}

/// Whether `s` is a PCI device (or vendor) id as libvirt writes them: `0x` and four hex digits.
pub fn is_pci_device_id(s: &str) -> bool {
    s.len() == 6
        && (s.starts_with("0x") || s.starts_with("0X"))
        && s[2..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `s` is a UUID in its 8-4-4-4-12 hex form (a mediated device's name).
pub fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_read_as_libvirt_and_lspci_write_them() {
        let a = PciAddress::parse("0000:41:00.0").unwrap();
        assert_eq!(
            a,
            PciAddress {
                domain: 0,
                bus: 0x41,
                slot: 0,
                function: 0
            }
        );
        assert_eq!(a.to_string(), "0000:41:00.0");
        assert_eq!(
            PciAddress::parse("c1:1f.7").unwrap().to_string(),
            "0000:c1:1f.7"
        );
        assert_eq!(
            PciAddress::parse("10000:00:00.0"),
            None,
            "domain over 16 bits"
        );
        for bad in [
            "",
            "41:00",
            "0000:41:20.0",
            "0000:41:00.8",
            "0000:4g:00.0",
            "0000::00.0",
            "x:y:z.w",
            "0000:41:00.0.1",
            "+000:41:00.0",
        ] {
            assert_eq!(PciAddress::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn device_ids_and_uuids() {
        assert!(is_pci_device_id("0x2330"));
        assert!(!is_pci_device_id("2330"));
        assert!(!is_pci_device_id("0x233"));
        assert!(!is_pci_device_id("0x23300"));
        assert!(is_uuid("c2177883-f1bb-47f0-914d-32a22e3a8804"));
        assert!(!is_uuid("c2177883-f1bb-47f0-914d-32a22e3a880"));
        assert!(!is_uuid("c2177883f1bb47f0914d32a22e3a8804"));
        assert!(!is_uuid("g2177883-f1bb-47f0-914d-32a22e3a8804"));
    }
}
