//! The XML the libvirt driver reads and writes: the domain template rendered for a lease (its
//! placeholders filled, then the lease's GPUs, metadata and SMBIOS OEM string spliced in), the
//! host's node devices read as GPUs, and the lease read back from a domain's metadata.
//!
//! The template is parsed (roxmltree) after its placeholders are filled, and the additions are
//! spliced into the text at the positions the parse found, so everything else in the template
//! reaches libvirt exactly as the operator wrote it.

use gpuwarden_schema::libvirt::{PciAddress, OEM_LEASE_PREFIX};

/// The XML namespace of gpuwarden's element in a domain's `<metadata>`.
pub(crate) const METADATA_NS: &str = "https://gpuwarden.io/xmlns/libvirt/1";
/// The prefix the driver writes that namespace with.
pub(crate) const METADATA_PREFIX: &str = "gpuwarden";

/// The placeholders a domain template may use.
pub(crate) const PLACEHOLDERS: [&str; 8] = [
    "name",
    "lease_id",
    "team",
    "user",
    "project",
    "workload",
    "gpu_model",
    "gpu_count",
];

/// What a lease's domain is made of, besides the template.
#[derive(Debug, Clone)]
pub(crate) struct DomainParts<'a> {
    /// Placeholder → value (unescaped); every name in [`PLACEHOLDERS`].
    pub(crate) values: Vec<(&'static str, String)>,
    /// The lease id, for the metadata and the OEM string.
    pub(crate) lease_id: &'a str,
    /// Team, user: kept in the metadata for an operator reading `virsh dumpxml`.
    pub(crate) team: &'a str,
    pub(crate) user: &'a str,
    /// The devices to pass through.
    pub(crate) devices: &'a [Passthrough],
}

/// One device passed through to a guest.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Passthrough {
    /// A whole PCI function (`<hostdev type='pci' managed='yes'>`).
    Pci(PciAddress),
    /// A mediated device (vGPU), by its UUID (`<hostdev type='mdev' model='vfio-pci'>`).
    Mdev(String),
}

impl std::fmt::Display for Passthrough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Pci(a) => write!(f, "{a}"),
            Self::Mdev(uuid) => write!(f, "mdev {uuid}"),
        }
    }
}

impl Passthrough {
    fn hostdev(&self) -> String {
        match self {
            Self::Pci(a) => format!(
                "<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x{:04x}' \
                 bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/></source></hostdev>",
                a.domain, a.bus, a.slot, a.function
            ),
            Self::Mdev(uuid) => format!(
                "<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address \
                 uuid='{}'/></source></hostdev>",
                escape(uuid)
            ),
        }
    }
}

/// Why a template cannot make a domain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TemplateError {
    /// A `{{...}}` the driver does not fill.
    #[error("unknown placeholder {{{{{0}}}}} (the template may use {list})", list = placeholder_list())]
    UnknownPlaceholder(String),
    /// The filled template is not XML.
    #[error("not well-formed XML once its placeholders are filled: {0}")]
    Xml(String),
    /// Something the driver needs is missing or in the way.
    #[error("{0}")]
    Shape(String),
}

fn placeholder_list() -> String {
    PLACEHOLDERS
        .iter()
        .map(|p| format!("{{{{{p}}}}}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Escapes text for an XML attribute value or element content.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\'' => out.push_str("&apos;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

/// Fills `{{name}}`-style placeholders with escaped values; any other `{{...}}` is an error.
fn fill(template: &str, values: &[(&'static str, String)]) -> Result<String, TemplateError> {
    let mut out = String::with_capacity(template.len() + 256);
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| TemplateError::Shape("a `{{` is never closed by `}}`".into()))?;
        let name = after[..end].trim();
        let value = values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| TemplateError::UnknownPlaceholder(name.to_owned()))?;
        out.push_str(&escape(value));
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// One splice into the filled template: replace `len` bytes at `at` with `text`.
struct Edit {
    at: usize,
    len: usize,
    text: String,
}

/// Renders a lease's domain: the template filled, then the passthrough devices added to
/// `<devices>`, gpuwarden's element to `<metadata>`, the OEM string to `<sysinfo
/// type='smbios'>`, and `<smbios mode='sysinfo'/>` to `<os>` (so the hypervisor hands the
/// sysinfo to the guest's firmware).
pub(crate) fn render(template: &str, parts: &DomainParts<'_>) -> Result<String, TemplateError> {
    let xml = fill(template, &parts.values)?;
    let doc = roxmltree::Document::parse(&xml).map_err(|e| TemplateError::Xml(e.to_string()))?;
    let domain = doc.root_element();
    if !domain.has_tag_name("domain") {
        return Err(TemplateError::Shape(format!(
            "the root element is <{}>, not <domain>",
            domain.tag_name().name()
        )));
    }
    let child = |name: &str| domain.children().find(|n| n.has_tag_name(name));
    let name = child("name")
        .ok_or_else(|| TemplateError::Shape("the domain has no <name>{{name}}</name>".into()))?;
    let name_value = parts
        .values
        .iter()
        .find(|(n, _)| *n == "name")
        .map(|(_, v)| v.as_str())
        .unwrap_or_default();
    if name.text().map(str::trim) != Some(name_value) {
        return Err(TemplateError::Shape(
            "<name> must be {{name}} (the driver finds a lease's domain by it)".into(),
        ));
    }
    let devices = child("devices")
        .ok_or_else(|| TemplateError::Shape("the domain has no <devices>".into()))?;
    let os = child("os").ok_or_else(|| TemplateError::Shape("the domain has no <os>".into()))?;

    let mut edits = Vec::new();
    let hostdevs: String = parts.devices.iter().map(Passthrough::hostdev).collect();
    edits.push(append_inside(&xml, devices, "devices", &hostdevs));

    let lease = format!(
        "<{p}:lease xmlns:{p}=\"{METADATA_NS}\"><{p}:id>{}</{p}:id><{p}:team>{}</{p}:team>\
         <{p}:user>{}</{p}:user></{p}:lease>",
        escape(parts.lease_id),
        escape(parts.team),
        escape(parts.user),
        p = METADATA_PREFIX,
    );
    match child("metadata") {
        Some(metadata) => {
            if metadata
                .children()
                .any(|n| n.tag_name().namespace() == Some(METADATA_NS))
            {
                return Err(TemplateError::Shape(format!(
                    "<metadata> already holds an element of {METADATA_NS}, which the driver writes"
                )));
            }
            edits.push(append_inside(&xml, metadata, "metadata", &lease));
        }
        None => edits.push(Edit {
            at: name.range().end,
            len: 0,
            text: format!("<metadata>{lease}</metadata>"),
        }),
    }

    let entry = format!("<entry>{}</entry>", escape(&oem_string(parts.lease_id)));
    let sysinfo = domain
        .children()
        .find(|n| n.has_tag_name("sysinfo") && n.attribute("type") == Some("smbios"));
    match sysinfo {
        Some(sysinfo) => match sysinfo.children().find(|n| n.has_tag_name("oemStrings")) {
            Some(oem) => edits.push(append_inside(&xml, oem, "oemStrings", &entry)),
            None => edits.push(append_inside(
                &xml,
                sysinfo,
                "sysinfo",
                &format!("<oemStrings>{entry}</oemStrings>"),
            )),
        },
        None => edits.push(Edit {
            at: name.range().end,
            len: 0,
            text: format!("<sysinfo type='smbios'><oemStrings>{entry}</oemStrings></sysinfo>"),
        }),
    }
    match os.children().find(|n| n.has_tag_name("smbios")) {
        Some(smbios) if smbios.attribute("mode") == Some("sysinfo") => {}
        Some(smbios) => {
            return Err(TemplateError::Shape(format!(
                "<os><smbios mode='{}'/> hides the lease from the guest; leave <smbios> out or \
                 use mode='sysinfo'",
                smbios.attribute("mode").unwrap_or_default()
            )))
        }
        None => edits.push(append_inside(&xml, os, "os", "<smbios mode='sysinfo'/>")),
    }

    edits.sort_by_key(|e| std::cmp::Reverse(e.at));
    let mut out = xml.clone();
    for edit in edits {
        out.replace_range(edit.at..edit.at + edit.len, &edit.text);
    }
    Ok(out)
}

/// An edit that puts `text` at the end of `node`'s content (turning `<x/>` into
/// `<x>text</x>`).
fn append_inside(xml: &str, node: roxmltree::Node<'_, '_>, tag: &str, text: &str) -> Edit {
    let range = node.range();
    let element = &xml[range.clone()];
    if let Some(start_tag) = element.strip_suffix("/>") {
        // `<x a='b'/>`: the start tag without its `/>`, the text, then a closing tag.
        Edit {
            at: range.start,
            len: range.len(),
            text: format!("{}>{text}</{}>", start_tag.trim_end(), qualified(node, tag)),
        }
    } else {
        let close = element.rfind("</").unwrap_or(element.len());
        Edit {
            at: range.start + close,
            len: 0,
            text: text.to_owned(),
        }
    }
}

/// The element's name as written (with its prefix, if the template used one).
fn qualified(node: roxmltree::Node<'_, '_>, tag: &str) -> String {
    match node
        .tag_name()
        .namespace()
        .and_then(|ns| node.lookup_prefix(ns))
    {
        Some(prefix) if !prefix.is_empty() => format!("{prefix}:{tag}"),
        _ => tag.to_owned(),
    }
}

/// The SMBIOS OEM string naming a lease.
pub(crate) fn oem_string(lease_id: &str) -> String {
    format!("{OEM_LEASE_PREFIX}{lease_id}")
}

/// The lease id in gpuwarden's metadata element, as `virDomainGetMetadata` returns it (the
/// element alone, its namespace's prefix chosen by libvirt).
pub(crate) fn metadata_lease(element: &str) -> Option<String> {
    let doc = roxmltree::Document::parse(element).ok()?;
    doc.root_element()
        .children()
        .find(|n| n.is_element() && n.tag_name().name() == "id")
        .and_then(|n| n.text())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
}

/// A GPU the host's libvirt lists as a node device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeGpu {
    /// The device's PCI address.
    pub(crate) address: PciAddress,
    /// The PCI device id, `0x2330`.
    pub(crate) product_id: String,
    /// The product's name in the host's PCI database, for messages.
    pub(crate) product: String,
}

/// NVIDIA's PCI vendor id.
const NVIDIA: &str = "0x10de";

/// Reads a node device's XML (`virNodeDeviceGetXMLDesc`): an NVIDIA display controller (PCI
/// class 0x0300xx VGA or 0x0302xx 3D) is a GPU; anything else is `None`.
pub(crate) fn node_gpu(xml: &str) -> Option<NodeGpu> {
    let doc = roxmltree::Document::parse(xml).ok()?;
    let cap = doc
        .root_element()
        .children()
        .find(|n| n.has_tag_name("capability") && n.attribute("type") == Some("pci"))?;
    let text = |name: &str| {
        cap.children()
            .find(|n| n.has_tag_name(name))
            .and_then(|n| n.text())
            .map(str::trim)
    };
    let class = text("class")?.to_ascii_lowercase();
    let class = class.strip_prefix("0x")?;
    if !(class.starts_with("0300") || class.starts_with("0302")) {
        return None;
    }
    let vendor = cap.children().find(|n| n.has_tag_name("vendor"))?;
    if !vendor.attribute("id")?.eq_ignore_ascii_case(NVIDIA) {
        return None;
    }
    let product = cap.children().find(|n| n.has_tag_name("product"))?;
    let number = |name: &str| -> Option<u32> {
        let t = text(name)?;
        match t.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16).ok(),
            None => t.parse().ok(),
        }
    };
    let address = PciAddress {
        domain: u16::try_from(number("domain")?).ok()?,
        bus: u8::try_from(number("bus")?).ok()?,
        slot: u8::try_from(number("slot")?).ok()?,
        function: u8::try_from(number("function")?).ok()?,
    };
    Some(NodeGpu {
        address,
        product_id: product.attribute("id")?.to_ascii_lowercase(),
        product: product.text().unwrap_or_default().trim().to_owned(),
    })
}

/// The devices a domain's XML passes through (its `<hostdev>`s of type `pci` and `mdev`).
pub(crate) fn hostdevs(domain_xml: &str) -> Vec<Passthrough> {
    let Ok(doc) = roxmltree::Document::parse(domain_xml) else {
        return Vec::new();
    };
    let number = |n: roxmltree::Node<'_, '_>, name: &str| -> Option<u32> {
        let v = n.attribute(name)?;
        match v.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16).ok(),
            None => v.parse().ok(),
        }
    };
    doc.descendants()
        .filter(|n| n.has_tag_name("hostdev"))
        .filter_map(|h| {
            let address = h
                .children()
                .find(|n| n.has_tag_name("source"))?
                .children()
                .find(|n| n.has_tag_name("address"))?;
            match h.attribute("type")? {
                "pci" => Some(Passthrough::Pci(PciAddress {
                    domain: u16::try_from(number(address, "domain").unwrap_or(0)).ok()?,
                    bus: u8::try_from(number(address, "bus")?).ok()?,
                    slot: u8::try_from(number(address, "slot")?).ok()?,
                    function: u8::try_from(number(address, "function")?).ok()?,
                })),
                "mdev" => Some(Passthrough::Mdev(
                    address.attribute("uuid")?.to_ascii_lowercase(),
                )),
                _ => None,
            }
        })
        .collect()
}

/// The source files of a domain's file-backed disks (`<disk type='file' device='disk'>`), for
/// `delete_disks`.
pub(crate) fn disk_files(domain_xml: &str) -> Vec<String> {
    let Ok(doc) = roxmltree::Document::parse(domain_xml) else {
        return Vec::new();
    };
    doc.descendants()
        .filter(|n| {
            n.has_tag_name("disk")
                && n.attribute("type") == Some("file")
                && n.attribute("device").unwrap_or("disk") == "disk"
        })
        .filter_map(|d| d.children().find(|n| n.has_tag_name("source")))
        .filter_map(|s| s.attribute("file").map(str::to_owned))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts<'a>(devices: &'a [Passthrough]) -> DomainParts<'a> {
        DomainParts {
            values: vec![
                ("name", "gpuwarden-l-1".into()),
                ("lease_id", "l-1".into()),
                ("team", "vision".into()),
                ("user", "ada <a&b>".into()),
                ("project", "p".into()),
                ("workload", "training".into()),
                ("gpu_model", "NVIDIA H100 80GB HBM3".into()),
                ("gpu_count", "2".into()),
            ],
            lease_id: "l-1",
            team: "vision",
            user: "ada <a&b>",
            devices,
        }
    }

    const MINIMAL: &str = "<domain type='kvm'><name>{{name}}</name><memory unit='GiB'>8</memory>\
        <description>{{user}} for {{team}}</description><os><type>hvm</type></os><devices/></domain>";

    #[test]
    fn a_minimal_template_gets_hostdevs_metadata_and_the_oem_string() {
        let devices = [
            Passthrough::Pci(PciAddress::parse("0000:41:00.0").unwrap()),
            Passthrough::Mdev("c2177883-f1bb-47f0-914d-32a22e3a8804".into()),
        ];
        let xml = render(MINIMAL, &parts(&devices)).unwrap();
        let doc = roxmltree::Document::parse(&xml).unwrap();
        let d = doc.root_element();
        let hostdevs: Vec<_> = d
            .descendants()
            .filter(|n| n.has_tag_name("hostdev"))
            .collect();
        assert_eq!(hostdevs.len(), 2);
        assert_eq!(hostdevs[0].attribute("type"), Some("pci"));
        assert_eq!(hostdevs[0].attribute("managed"), Some("yes"));
        let address = hostdevs[0]
            .descendants()
            .find(|n| n.has_tag_name("address"))
            .unwrap();
        assert_eq!(address.attribute("bus"), Some("0x41"));
        assert_eq!(address.attribute("domain"), Some("0x0000"));
        assert_eq!(hostdevs[1].attribute("type"), Some("mdev"));
        assert_eq!(super::hostdevs(&xml), devices, "read back");
        let lease = d
            .descendants()
            .find(|n| {
                n.tag_name().namespace() == Some(METADATA_NS) && n.has_tag_name((METADATA_NS, "id"))
            })
            .unwrap();
        assert_eq!(lease.text(), Some("l-1"));
        let entry = d.descendants().find(|n| n.has_tag_name("entry")).unwrap();
        assert_eq!(entry.text(), Some("gpuwarden.lease_id=l-1"));
        let smbios = d.descendants().find(|n| n.has_tag_name("smbios")).unwrap();
        assert_eq!(smbios.attribute("mode"), Some("sysinfo"));
        let description = d
            .children()
            .find(|n| n.has_tag_name("description"))
            .unwrap();
        assert_eq!(
            description.text(),
            Some("ada <a&b> for vision"),
            "escaped, read back"
        );
    }

    #[test]
    fn existing_metadata_sysinfo_and_devices_are_kept_and_extended() {
        let template = "<domain type='kvm'>\n  <name>{{name}}</name>\n  <metadata><x:a xmlns:x='urn:x'/></metadata>\n  \
            <sysinfo type='smbios'><bios><entry name='vendor'>v</entry></bios><oemStrings><entry>other</entry></oemStrings></sysinfo>\n  \
            <os><type>hvm</type><smbios mode='sysinfo'/></os>\n  <devices><disk type='file' device='disk'><source file='/v/{{lease_id}}.qcow2'/></disk></devices>\n</domain>";
        let xml = render(template, &parts(&[])).unwrap();
        let doc = roxmltree::Document::parse(&xml).unwrap();
        let entries: Vec<_> = doc
            .descendants()
            .filter(|n| n.has_tag_name("entry") && n.parent().unwrap().has_tag_name("oemStrings"))
            .map(|n| n.text().unwrap())
            .collect();
        assert_eq!(entries, ["other", "gpuwarden.lease_id=l-1"]);
        assert_eq!(
            doc.descendants()
                .filter(|n| n.has_tag_name("smbios"))
                .count(),
            1
        );
        assert_eq!(
            doc.descendants()
                .filter(|n| n.has_tag_name("metadata"))
                .count(),
            1
        );
        assert!(doc.descendants().any(|n| n.has_tag_name(("urn:x", "a"))));
        assert_eq!(disk_files(&xml), ["/v/l-1.qcow2"]);
        assert!(
            xml.starts_with("<domain type='kvm'>\n  <name>gpuwarden-l-1</name>"),
            "the rest as written"
        );
    }

    #[test]
    fn templates_that_cannot_make_a_lease_domain_say_why() {
        let cases = [
            (
                "<domain><name>{{name}}</name><os/><devices/>{{gpus}}</domain>",
                "unknown placeholder {{gpus}}",
            ),
            (
                "<domain><name>fixed</name><os/><devices/></domain>",
                "<name> must be {{name}}",
            ),
            (
                "<domain><name>{{name}}</name><os/></domain>",
                "no <devices>",
            ),
            (
                "<domain><name>{{name}}</name><devices/></domain>",
                "no <os>",
            ),
            ("<vm><name>{{name}}</name></vm>", "not <domain>"),
            (
                "<domain><name>{{name}}</name><os/><devices></domain>",
                "not well-formed",
            ),
            ("<domain><name>{{name</name></domain>", "never closed"),
            (
                "<domain><name>{{name}}</name><os><smbios mode='host'/></os><devices/></domain>",
                "mode='host'",
            ),
        ];
        for (template, why) in cases {
            let err = render(template, &parts(&[])).unwrap_err().to_string();
            assert!(err.contains(why), "{template}: {err}");
        }
    }

    #[test]
    fn node_devices_nvidia_display_controllers_only() {
        let gpu = "<device><name>pci_0000_41_00_0</name><capability type='pci'><class>0x030200</class>\
            <domain>0</domain><bus>65</bus><slot>0</slot><function>0</function>\
            <product id='0x2330'>GH100 [H100 SXM5 80GB]</product><vendor id='0x10de'>NVIDIA Corporation</vendor>\
            </capability></device>";
        let g = node_gpu(gpu).unwrap();
        assert_eq!(g.address.to_string(), "0000:41:00.0");
        assert_eq!(g.product_id, "0x2330");
        let audio = gpu.replace("0x030200", "0x040300");
        assert_eq!(node_gpu(&audio), None, "the GPU's HDMI audio function");
        let other = gpu.replace("0x10de", "0x1002");
        assert_eq!(node_gpu(&other), None, "not NVIDIA");
        assert_eq!(
            node_gpu("<device><name>computer</name><capability type='system'/></device>"),
            None
        );
        assert_eq!(node_gpu("not xml"), None);
    }

    #[test]
    fn the_lease_reads_back_from_metadata() {
        assert_eq!(
            metadata_lease(
                "<lease xmlns=\"https://gpuwarden.io/xmlns/libvirt/1\">\n  <id>l-9</id>\n</lease>"
            ),
            Some("l-9".into())
        );
        assert_eq!(metadata_lease("<lease><id> </id></lease>"), None);
        assert_eq!(metadata_lease("<"), None);
    }
}
