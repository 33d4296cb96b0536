//! The manifests of `deploy/kubernetes/` as the API server would read them (no API server can be
//! installed here): every YAML document of every file parses, names a kind this test knows, and
//! deserializes into that kind's `k8s-openapi` type (Kubernetes 1.33's API) with nothing left
//! over: k8s-openapi ignores fields it does not know, so the object is written back to JSON and
//! compared with the YAML, which catches a misspelt or misplaced field. cert-manager's two
//! kinds, which k8s-openapi lacks, are read into the fields this repository uses, refusing any
//! other. Then the files are checked against each other and against the enforcer's config:
//! the ConfigMap's TOML files load as gpuwarden's config, and the ports, paths, names and
//! Secrets the manifests and the config share agree; the enforcer runs as replicas that share a
//! PostgreSQL lease store and keep nothing on a volume of their own, with a rollout, a
//! disruption budget and a spread that leave one answering.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PersistentVolumeClaim, PodSpec, Service, ServiceAccount,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

/// cert-manager's `Certificate` (cert-manager.io/v1), the fields used here.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Certificate {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: CertificateSpec,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CertificateSpec {
    secret_name: String,
    #[serde(rename = "isCA", default, skip_serializing_if = "Option::is_none")]
    is_ca: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    common_name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    dns_names: Vec<String>,
    duration: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    renew_before: Option<String>,
    private_key: CertificatePrivateKey,
    issuer_ref: IssuerRef,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CertificatePrivateKey {
    algorithm: String,
    size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rotation_policy: Option<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct IssuerRef {
    name: String,
    kind: String,
}

/// cert-manager's `Issuer` (cert-manager.io/v1), self-signed.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Issuer {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: IssuerSpec,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct IssuerSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    self_signed: Option<BTreeMap<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ca: Option<CaIssuer>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CaIssuer {
    secret_name: String,
}

/// Every object of the manifests, by kind.
#[derive(Debug)]
enum Object {
    Namespace(Box<Namespace>),
    ServiceAccount(Box<ServiceAccount>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    ConfigMap(Box<ConfigMap>),
    PersistentVolumeClaim(Box<PersistentVolumeClaim>),
    Deployment(Box<Deployment>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
    DaemonSet(Box<DaemonSet>),
    Service(Box<Service>),
    ValidatingWebhookConfiguration(Box<ValidatingWebhookConfiguration>),
    Issuer(Box<Issuer>),
    Certificate(Box<Certificate>),
}

/// `document` as a `T`, failing with `what` if a field was dropped on the way: the object
/// written back must be the document itself.
fn typed<T: DeserializeOwned + Serialize>(what: &str, document: &Value) -> Box<T> {
    let object: T = serde_path_to_error::deserialize(document.clone())
        .unwrap_or_else(|e| panic!("{what}: field {}: {}", e.path(), e.inner()));
    let back = serde_json::to_value(&object).unwrap();
    if back != *document {
        panic!(
            "{what}: fields the type does not have (misspelt or misplaced?):\n{}",
            difference(document, &back, "")
        );
    }
    Box::new(object)
}

/// Where `read` (the YAML) and `written` (what the typed object keeps of it) differ.
fn difference(read: &Value, written: &Value, at: &str) -> String {
    match (read, written) {
        (Value::Object(a), Value::Object(b)) => {
            let mut out = String::new();
            for (k, v) in a {
                match b.get(k) {
                    Some(w) => out += &difference(v, w, &format!("{at}.{k}")),
                    None => out += &format!("  {at}.{k}: dropped\n"),
                }
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out += &format!("  {at}.{k}: added\n");
            }
            out
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .map(|(i, (x, y))| difference(x, y, &format!("{at}[{i}]")))
            .collect(),
        (a, b) if a == b => String::new(),
        (a, b) => format!("  {at}: {a} read, {b} written\n"),
    }
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::Namespace(_) => "Namespace",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::ConfigMap(_) => "ConfigMap",
            Object::PersistentVolumeClaim(_) => "PersistentVolumeClaim",
            Object::Deployment(_) => "Deployment",
            Object::PodDisruptionBudget(_) => "PodDisruptionBudget",
            Object::DaemonSet(_) => "DaemonSet",
            Object::Service(_) => "Service",
            Object::ValidatingWebhookConfiguration(_) => "ValidatingWebhookConfiguration",
            Object::Issuer(_) => "Issuer",
            Object::Certificate(_) => "Certificate",
        }
    }
}

fn object(what: &str, document: &Value) -> Object {
    let api_version = document["apiVersion"].as_str().unwrap_or_default();
    let kind = document["kind"].as_str().unwrap_or_default();
    match (api_version, kind) {
        ("v1", "Namespace") => Object::Namespace(typed(what, document)),
        ("v1", "ServiceAccount") => Object::ServiceAccount(typed(what, document)),
        ("v1", "ConfigMap") => Object::ConfigMap(typed(what, document)),
        ("v1", "PersistentVolumeClaim") => Object::PersistentVolumeClaim(typed(what, document)),
        ("v1", "Service") => Object::Service(typed(what, document)),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            Object::ClusterRole(typed(what, document))
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            Object::ClusterRoleBinding(typed(what, document))
        }
        ("apps/v1", "Deployment") => Object::Deployment(typed(what, document)),
        ("apps/v1", "DaemonSet") => Object::DaemonSet(typed(what, document)),
        ("policy/v1", "PodDisruptionBudget") => Object::PodDisruptionBudget(typed(what, document)),
        ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration") => {
            Object::ValidatingWebhookConfiguration(typed(what, document))
        }
        ("cert-manager.io/v1", "Issuer") => Object::Issuer(typed(what, document)),
        ("cert-manager.io/v1", "Certificate") => Object::Certificate(typed(what, document)),
        _ => panic!("{what}: kind {kind:?} of {api_version:?} is not one this test checks; add it"),
    }
}

/// Every object of every `deploy/kubernetes/*.yaml`, with the file it is in.
fn objects() -> Vec<(String, Object)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        // kustomize's own file, not an object for the API server: its own test below.
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 8, "{files:?}");
    let mut out = Vec::new();
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&file).unwrap();
        let documents: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{name} is not YAML: {e}"));
        assert!(!documents.is_empty(), "{name} has no document");
        for (i, document) in documents.iter().enumerate() {
            if document.is_null() {
                continue;
            }
            let what = format!("{name}, document {}", i + 1);
            out.push((name.clone(), object(&what, document)));
        }
    }
    out
}

fn container<'a>(spec: &'a PodSpec, name: &str) -> &'a Container {
    spec.containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The port number `container` names `name`.
fn container_port(container: &Container, name: &str) -> i32 {
    container
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("container {} has no port {name}", container.name))
        .container_port
}

/// The volume mounted at the longest mount path of `container` that holds `path`.
fn volume_holding<'a>(spec: &'a PodSpec, container: &Container, path: &Path) -> &'a str {
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| path.starts_with(&m.mount_path))
        .max_by_key(|m| m.mount_path.len())
        .unwrap_or_else(|| panic!("{} is on no volume of {}", path.display(), container.name));
    &spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap_or_else(|| panic!("volume {} is mounted but not declared", mount.name))
        .name
}

/// The config file a container's `--config` names, read from the ConfigMap mounted there.
fn config_of(spec: &PodSpec, container: &Container, config_map: &ConfigMap) -> String {
    let args = container.args.as_ref().expect("args");
    let i = args.iter().position(|a| a == "--config").expect("--config");
    let path = Path::new(&args[i + 1]);
    let volume = volume_holding(spec, container, path);
    let source = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == volume)
        .and_then(|v| v.config_map.as_ref())
        .unwrap_or_else(|| panic!("{} is not on a ConfigMap volume", path.display()));
    assert_eq!(source.name, config_map.metadata.name.clone().unwrap());
    let key = path.file_name().unwrap().to_str().unwrap();
    config_map
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .unwrap_or_else(|| panic!("the ConfigMap has no {key}"))
        .clone()
}

/// Whether `selector` selects a pod labelled `labels` (matchLabels and the operators of
/// matchExpressions).
fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let labelled = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let matched = selector.match_expressions.iter().flatten().all(|e| {
        let values = e.values.as_deref().unwrap_or_default();
        let value = labels.get(&e.key);
        match e.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => !value.is_some_and(|v| values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            other => panic!("label selector operator {other}"),
        }
    });
    let some = selector
        .match_labels
        .as_ref()
        .is_some_and(|m| !m.is_empty())
        || selector
            .match_expressions
            .as_ref()
            .is_some_and(|m| !m.is_empty());
    some && labelled && matched
}

#[test]
fn the_kubernetes_manifests_are_valid_objects_that_agree_with_each_other_and_the_config() {
    let objects = objects();
    let one = |kind: &str| -> &Object {
        let found: Vec<&Object> = objects
            .iter()
            .map(|(_, o)| o)
            .filter(|o| o.kind() == kind)
            .collect();
        assert_eq!(found.len(), 1, "one {kind}");
        found[0]
    };
    let Object::Deployment(deployment) = one("Deployment") else {
        unreachable!()
    };
    let Object::Service(service) = one("Service") else {
        unreachable!()
    };
    let Object::ValidatingWebhookConfiguration(webhooks) = one("ValidatingWebhookConfiguration")
    else {
        unreachable!()
    };
    let Object::ConfigMap(config_map) = one("ConfigMap") else {
        unreachable!()
    };
    let Object::DaemonSet(collector) = one("DaemonSet") else {
        unreachable!()
    };
    let Object::ClusterRoleBinding(binding) = one("ClusterRoleBinding") else {
        unreachable!()
    };
    let Object::Namespace(ns) = one("Namespace") else {
        unreachable!()
    };
    let namespace = ns.metadata.name.as_deref().unwrap();
    // What the driver does with the API, granted.
    let Object::ClusterRole(role) = one("ClusterRole") else {
        unreachable!()
    };
    let grants = |group: &str, resource: &str, verb: &str| {
        role.rules.iter().flatten().any(|r| {
            r.api_groups.iter().flatten().any(|g| g == group)
                && r.resources.iter().flatten().any(|x| x == resource)
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    for (group, resource, verb) in [
        ("", "nodes", "list"),
        ("", "pods", "get"),
        ("", "pods", "delete"),
        ("", "pods", "watch"),
    ] {
        assert!(grants(group, resource, verb), "{verb} {resource}");
    }
    assert_eq!(binding.role_ref.name, role.metadata.name.clone().unwrap());
    for (file, o) in &objects {
        let meta = match o {
            Object::ServiceAccount(x) => &x.metadata,
            Object::ConfigMap(x) => &x.metadata,
            Object::PersistentVolumeClaim(x) => &x.metadata,
            Object::Deployment(x) => &x.metadata,
            Object::PodDisruptionBudget(x) => &x.metadata,
            Object::DaemonSet(x) => &x.metadata,
            Object::Service(x) => &x.metadata,
            Object::Issuer(x) => &x.metadata,
            Object::Certificate(x) => &x.metadata,
            _ => continue,
        };
        assert_eq!(meta.namespace.as_deref(), Some(namespace), "{file}");
    }

    // The enforcer's config loads, and its listeners are the container's ports.
    // The config reads these from the environment (the Deployment and the DaemonSet set them).
    std::env::set_var("GPUWARDEN_SIGNING_KEY", "0".repeat(64));
    std::env::set_var("NODE_NAME", "gpu-node-1");
    let pod = deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let enforcer = container(pod, "enforcer");
    assert_eq!(enforcer.args.as_ref().unwrap()[0], "enforce");
    let text = config_of(pod, enforcer, config_map);
    let config = gpuwarden_schema::config::parse("gpuwarden.toml", &text)
        .unwrap_or_else(|e| panic!("the ConfigMap's gpuwarden.toml: {e}"));
    let env: Vec<&str> = enforcer
        .env
        .iter()
        .flatten()
        .map(|e| e.name.as_str())
        .collect();
    assert!(env.contains(&"GPUWARDEN_SIGNING_KEY"), "{env:?}");
    let [substrate] = config.substrates.as_slice() else {
        panic!("one substrate")
    };
    let kubernetes = substrate
        .kubernetes
        .as_ref()
        .expect("[substrates.kubernetes]");
    assert!(
        kubernetes.kubeconfig.is_none(),
        "in the cluster: the service account"
    );
    assert_eq!(
        i32::from(kubernetes.webhook_listen.port()),
        container_port(enforcer, "webhook")
    );
    assert_eq!(
        i32::from(config.enforcer.listen.port()),
        container_port(enforcer, "api")
    );
    let tls_volume = volume_holding(pod, enforcer, &kubernetes.webhook_tls.cert);
    assert_eq!(
        tls_volume,
        volume_holding(pod, enforcer, &kubernetes.webhook_tls.key)
    );
    let tls_secret = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == tls_volume)
        .and_then(|v| v.secret.as_ref())
        .and_then(|s| s.secret_name.clone())
        .expect("the webhook's certificate comes from a Secret");
    assert!(
        !enforcer
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.sub_path.is_some()),
        "a subPath mount never sees a renewed Secret"
    );
    // The lease store is PostgreSQL, shared by the replicas, its password a file from a
    // Secret; the pod's data_dir is its own scratch, on no volume that a second replica could
    // not mount or that would pin a replica to one node.
    let gpuwarden_schema::config::StoreLocation::Postgres { url, password_file } =
        config.enforcer_store()
    else {
        panic!(
            "the enforcers' lease store is PostgreSQL, not {:?}",
            config.enforcer_store()
        )
    };
    assert!(
        !url.contains(":@") && url.matches('@').count() <= 1,
        "{url}"
    );
    assert!(
        !url.contains("password="),
        "the password is in password_file, not in the URL: {url}"
    );
    let password_file = password_file.expect("enforcer.store.password_file");
    let password_volume = volume_holding(pod, enforcer, &password_file);
    let secret = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == password_volume)
        .and_then(|v| v.secret.as_ref())
        .expect("the PostgreSQL password comes from a Secret");
    let mount = enforcer
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == password_volume)
        .unwrap();
    let in_volume = password_file.strip_prefix(&mount.mount_path).unwrap();
    if let Some(items) = &secret.items {
        assert!(
            items.iter().any(|i| Path::new(&i.path) == in_volume),
            "the Secret's items put {} at {}",
            in_volume.display(),
            password_file.display()
        );
    }
    let data_dir = config.storage.data_dir.clone();
    let data = volume_holding(pod, enforcer, &data_dir);
    assert!(
        pod.volumes
            .iter()
            .flatten()
            .any(|v| v.name == data && v.empty_dir.is_some()),
        "data_dir is an emptyDir"
    );
    for volume in pod.volumes.iter().flatten() {
        assert!(
            volume.persistent_volume_claim.is_none() && volume.ephemeral.is_none(),
            "volume {} is claimed storage: the replicas share nothing but PostgreSQL",
            volume.name
        );
    }
    for (file, o) in &objects {
        if let Object::PersistentVolumeClaim(claim) = o {
            panic!(
                "{file}: PersistentVolumeClaim {:?} (access modes {:?}): the enforcer keeps \
                 its leases in PostgreSQL",
                claim.metadata.name,
                claim.spec.as_ref().and_then(|s| s.access_modes.clone())
            );
        }
    }
    // Replicas share the signals' consumer group, so no fixed static-member id.
    assert_eq!(
        config.kafka.group_instance_id, None,
        "one kafka.group_instance_id for every replica fences all but one"
    );

    // Replicas: two or more, replaced one at a time with one always ready, spread over nodes,
    // and kept by a disruption budget.
    let deployment_spec = deployment.spec.as_ref().unwrap();
    let replicas = deployment_spec.replicas.unwrap_or(1);
    assert!(replicas >= 2, "{replicas} replica(s)");
    let strategy = deployment_spec.strategy.as_ref().expect("a strategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.as_ref().expect("rollingUpdate");
    let unavailable = match rolling.max_unavailable.as_ref() {
        Some(IntOrString::Int(n)) => *n,
        other => panic!("maxUnavailable as a number of pods, not {other:?}"),
    };
    assert!(
        (0..=1).contains(&unavailable) && replicas - unavailable >= 1,
        "maxUnavailable {unavailable} of {replicas}"
    );
    if unavailable == 0 {
        assert!(
            matches!(rolling.max_surge, Some(IntOrString::Int(n)) if n >= 1),
            "with maxUnavailable 0 a rollout needs a surge pod: {:?}",
            rolling.max_surge
        );
    }
    let pod_labels = deployment_spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    assert!(selects(&deployment_spec.selector, &pod_labels));
    let Object::PodDisruptionBudget(budget) = one("PodDisruptionBudget") else {
        unreachable!()
    };
    let budget_spec = budget.spec.as_ref().unwrap();
    assert!(
        selects(budget_spec.selector.as_ref().unwrap(), &pod_labels),
        "the PodDisruptionBudget selects the enforcer's pods"
    );
    assert_eq!(budget_spec.min_available, Some(IntOrString::Int(1)));
    assert!(budget_spec.max_unavailable.is_none());
    let spread = pod
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| {
            a.preferred_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .expect("preferred pod anti-affinity");
    assert!(
        spread.iter().any(|term| {
            let term = &term.pod_affinity_term;
            term.topology_key == "kubernetes.io/hostname"
                && term
                    .label_selector
                    .as_ref()
                    .is_some_and(|s| selects(s, &pod_labels))
        }),
        "the replicas prefer different nodes: {spread:?}"
    );
    assert!(
        pod.affinity
            .as_ref()
            .and_then(|a| a.pod_anti_affinity.as_ref())
            .is_some_and(|a| a
                .required_during_scheduling_ignored_during_execution
                .is_none()),
        "preferred, not required: a small cluster or a surge pod still schedules"
    );
    // Ready once it can decide, alive while it serves (gpuwarden_enforcer::api's routes).
    for (probe, path) in [
        (&enforcer.readiness_probe, "/readyz"),
        (&enforcer.liveness_probe, "/healthz"),
    ] {
        let get = probe.as_ref().and_then(|p| p.http_get.as_ref()).unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        assert!(
            gpuwarden_enforcer::api::openapi_json().contains(&format!("\"{path}\"")),
            "the enforcer's API serves {path}"
        );
        assert_eq!(
            get.scheme.as_deref(),
            Some(if config.enforcer.tls.is_some() {
                "HTTPS"
            } else {
                "HTTP"
            })
        );
    }
    let subject = &binding.subjects.as_ref().unwrap()[0];
    assert_eq!(pod.service_account_name.as_ref(), Some(&subject.name));
    assert_eq!(subject.namespace.as_deref(), Some(namespace));

    // The Service reaches the Deployment's pods on the container's ports, and the webhook the
    // Service.
    let service_spec = service.spec.as_ref().unwrap();
    for (k, v) in service_spec.selector.as_ref().unwrap() {
        assert_eq!(
            pod_labels.get(k),
            Some(v),
            "the Service selects the enforcer"
        );
    }
    let [webhook] = webhooks.webhooks.as_deref().unwrap() else {
        panic!("one webhook")
    };
    let target = webhook.client_config.service.as_ref().unwrap();
    assert_eq!(Some(target.name.as_str()), service.metadata.name.as_deref());
    assert_eq!(target.namespace, namespace);
    assert_eq!(target.path.as_deref(), Some("/validate"));
    let port = service_spec
        .ports
        .iter()
        .flatten()
        .find(|p| Some(p.port) == target.port)
        .expect("the webhook's port is the Service's");
    let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name) =
        port.target_port.as_ref().unwrap()
    else {
        panic!("target ports by name")
    };
    assert_eq!(name, "webhook");
    assert_eq!(webhook.admission_review_versions, ["v1"]);
    assert_eq!(webhook.side_effects, "NoneOnDryRun");
    let timeout = webhook.timeout_seconds.unwrap();
    assert!((1..=30).contains(&timeout), "{timeout}");

    // The certificate names what the API server connects to, fills the Secret the enforcer
    // reads, and is the one whose CA is injected; its issuer is a CA whose key is in the Secret
    // of a CA certificate.
    let certificates: Vec<&Certificate> = objects
        .iter()
        .filter_map(|(_, o)| match o {
            Object::Certificate(c) => Some(&**c),
            _ => None,
        })
        .collect();
    let certificate = certificates
        .iter()
        .find(|c| c.spec.secret_name == tls_secret)
        .expect("a Certificate fills the webhook's Secret");
    let issuer = objects
        .iter()
        .find_map(|(_, o)| match o {
            Object::Issuer(i)
                if i.metadata.name.as_ref() == Some(&certificate.spec.issuer_ref.name) =>
            {
                Some(i)
            }
            _ => None,
        })
        .expect("the webhook certificate's Issuer");
    let ca_secret = &issuer.spec.ca.as_ref().expect("a CA issuer").secret_name;
    assert!(certificates
        .iter()
        .any(|c| c.spec.is_ca == Some(true) && &c.spec.secret_name == ca_secret));
    let svc_name = format!("{}.{}.svc", target.name, target.namespace);
    assert!(certificate.spec.dns_names.contains(&svc_name), "{svc_name}");
    assert_eq!(
        webhooks
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("cert-manager.io/inject-ca-from")),
        Some(&format!(
            "{}/{}",
            certificate.metadata.namespace.as_deref().unwrap(),
            certificate.metadata.name.as_deref().unwrap()
        ))
    );

    // The collector's config loads and its kubelet paths are mounted from the node.
    let pod = collector
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let agent = container(pod, "collector");
    assert_eq!(agent.args.as_ref().unwrap()[0], "collect");
    let text = config_of(pod, agent, config_map);
    let config = gpuwarden_schema::config::parse("collector.toml", &text)
        .unwrap_or_else(|e| panic!("the ConfigMap's collector.toml: {e}"));
    assert_eq!(config.collector.host.as_deref(), Some("gpu-node-1"));
    assert_eq!(pod.host_pid, Some(true));
    for path in [
        config
            .collector
            .kubelet_socket
            .clone()
            .expect("kubelet_socket"),
        config.collector.pod_logs_dir.clone(),
    ] {
        let volume = volume_holding(pod, agent, &path);
        let host_path = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == volume)
            .and_then(|v| v.host_path.as_ref())
            .unwrap_or_else(|| panic!("{} is not from the node", path.display()));
        assert!(path.starts_with(&host_path.path), "{}", path.display());
    }
    assert_eq!(
        i32::from(config.collector.metrics_listen.port()),
        container_port(agent, "metrics")
    );
}

/// A pod as the API server stores it, with `containers` and `init_containers` as given.
fn pod(containers: Value, init_containers: Option<Value>) -> Value {
    let mut spec = serde_json::json!({
        "containers": containers,
        "restartPolicy": "Always",
        "dnsPolicy": "ClusterFirst",
        "schedulerName": "default-scheduler",
    });
    if let Some(init) = init_containers {
        spec["initContainers"] = init;
    }
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ml", "uid": "0c6b1c56-57f0-4d4e-9d2b-1b2f0a8d3c11"},
        "spec": spec,
        "status": {"phase": "Pending"}
    })
}

fn container_with(resources: Option<Value>) -> Value {
    let mut c = serde_json::json!({"name": "main", "image": "registry.example.com/app:1"});
    if let Some(r) = resources {
        c["resources"] = r;
    }
    c
}

/// The webhook's `matchConditions` expression, evaluated by a CEL interpreter (cel-rust, not
/// the API server's cel-go, which also type-checks it when the configuration is applied) on the
/// pods the API server would send and those it should not.
#[test]
fn the_webhook_match_condition_sends_gpu_pods_only() {
    let text = std::fs::read_to_string(deploy_dir().join("webhook.yaml")).unwrap();
    let configuration: ValidatingWebhookConfiguration = serde_saphyr::from_str(&text).unwrap();
    let webhook = &configuration.webhooks.unwrap()[0];
    let conditions = webhook.match_conditions.as_ref().unwrap();
    assert_eq!(conditions.len(), 1);
    let program = cel::Program::compile(&conditions[0].expression)
        .unwrap_or_else(|e| panic!("the matchConditions expression does not parse: {e}"));
    let sends = |object: &Value| -> bool {
        let mut context = cel::Context::default();
        context.add_variable("object", object.clone()).unwrap();
        match program.execute(&context) {
            Ok(cel::Value::Bool(b)) => b,
            other => panic!("the expression gave {other:?} for {object}"),
        }
    };
    let gpus =
        |key: &str, n: &str| serde_json::json!({ key: {"nvidia.com/gpu": n, "memory": "8Gi"} });
    let cases: Vec<(&str, Value, bool)> = vec![
        (
            "a GPU limit",
            pod(
                serde_json::json!([container_with(Some(gpus("limits", "2")))]),
                None,
            ),
            true,
        ),
        (
            "a GPU request only",
            pod(
                serde_json::json!([container_with(Some(gpus("requests", "1")))]),
                None,
            ),
            true,
        ),
        (
            "a MIG device",
            pod(
                serde_json::json!([container_with(Some(
                    serde_json::json!({"limits": {"nvidia.com/mig-1g.10gb": "1"}})
                ))]),
                None,
            ),
            true,
        ),
        (
            "GPUs in the second container",
            pod(
                serde_json::json!([
                    container_with(None),
                    container_with(Some(gpus("limits", "1")))
                ]),
                None,
            ),
            true,
        ),
        (
            "GPUs in an init container",
            pod(
                serde_json::json!([container_with(None)]),
                Some(serde_json::json!([container_with(Some(gpus(
                    "limits", "1"
                )))])),
            ),
            true,
        ),
        (
            "no resources at all",
            pod(serde_json::json!([container_with(None)]), None),
            false,
        ),
        (
            "empty resources",
            pod(
                serde_json::json!([container_with(Some(serde_json::json!({})))]),
                None,
            ),
            false,
        ),
        (
            "CPU and memory only",
            pod(
                serde_json::json!([container_with(Some(
                    serde_json::json!({"limits": {"cpu": "2", "memory": "4Gi"}, "requests": {"cpu": "1"}})
                ))]),
                None,
            ),
            false,
        ),
        (
            "another vendor's device",
            pod(
                serde_json::json!([container_with(Some(
                    serde_json::json!({"limits": {"amd.com/gpu": "1", "nvidia.com/gpu-driver": "1"}})
                ))]),
                None,
            ),
            false,
        ),
        (
            "init containers without GPUs",
            pod(
                serde_json::json!([container_with(None)]),
                Some(serde_json::json!([container_with(Some(
                    serde_json::json!({"limits": {"cpu": "1"}})
                ))])),
            ),
            false,
        ),
    ];
    for (what, object, expected) in &cases {
        assert_eq!(sends(object), *expected, "{what}");
    }
}

/// `kustomization.yaml`, the fields used here (kustomize's `Kustomization`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    api_version: String,
    kind: String,
    resources: Vec<String>,
    images: Vec<KustomizeImage>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KustomizeImage {
    name: String,
    new_name: String,
    new_tag: String,
}

/// The image is named in one place: kustomization.yaml's `images:` replaces the name
/// `gpuwarden`, which every container of the manifests uses, with the registry's reference at
/// this release's version; its resources are every manifest but the two applied at steps of
/// their own (cert-manager.yaml, webhook.yaml); every container runs the binary where the
/// image (deploy/image/build) puts it.
#[test]
fn the_image_is_named_once_in_the_kustomization() {
    let text = std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap();
    let kustomization: Kustomization = serde_saphyr::from_str(&text)
        .unwrap_or_else(|e| panic!("kustomization.yaml has a field kustomize does not: {e}"));
    assert_eq!(kustomization.api_version, "kustomize.config.k8s.io/v1beta1");
    assert_eq!(kustomization.kind, "Kustomization");
    let mut resources = kustomization.resources.clone();
    resources.sort();
    let mut manifests: Vec<String> = objects().into_iter().map(|(file, _)| file).collect();
    manifests.sort();
    manifests.dedup();
    manifests.retain(|f| f != "cert-manager.yaml" && f != "webhook.yaml");
    assert_eq!(resources, manifests, "kustomization.yaml's resources");

    assert_eq!(kustomization.images.len(), 1, "{:?}", kustomization.images);
    let image = &kustomization.images[0];
    assert_eq!(image.name, "gpuwarden");
    assert!(!image.new_name.is_empty() && !image.new_name.contains(':'));
    assert_eq!(
        image.new_tag,
        env!("CARGO_PKG_VERSION"),
        "the release's tag"
    );

    let build =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/image/build"))
            .unwrap();
    assert!(build.contains("--config.entrypoint /usr/local/bin/gpuwarden"));
    let mut containers = 0;
    for (file, object) in objects() {
        let spec = match &object {
            Object::Deployment(d) => d.spec.as_ref().unwrap().template.spec.clone(),
            Object::DaemonSet(d) => d.spec.as_ref().unwrap().template.spec.clone(),
            _ => continue,
        };
        let spec = spec.unwrap();
        for container in spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
        {
            containers += 1;
            assert_eq!(
                container.image.as_deref(),
                Some("gpuwarden"),
                "{file}: container {}",
                container.name
            );
            assert_eq!(
                container.command.as_deref(),
                Some(&["/usr/local/bin/gpuwarden".to_string()][..]),
                "{file}: container {}",
                container.name
            );
        }
    }
    assert!(containers >= 2, "the enforcer's and the collector's");
}
