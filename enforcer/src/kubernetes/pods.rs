//! What a pod asks for, read from its spec the way the scheduler reads it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, PodSpec};

use crate::drivers::kubernetes::{whole_quantity, GPU_RESOURCE, MIG_RESOURCE_PREFIX};

/// The GPUs a pod asks for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuAsk {
    /// How many devices, of [`GpuAsk::resource`].
    pub count: u64,
    /// `nvidia.com/gpu`, or a MIG resource `nvidia.com/mig-<profile>`.
    pub resource: String,
}

impl GpuAsk {
    /// The MIG profile (`1g.10gb`) of a MIG ask.
    pub fn mig_profile(&self) -> Option<&str> {
        self.resource.strip_prefix(MIG_RESOURCE_PREFIX)
    }
}

/// Why a pod's GPUs cannot be counted: a person's mistake, which the webhook answers with a
/// denial naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uncountable(pub String);

/// The GPU resources (`nvidia.com/gpu`, `nvidia.com/mig-*`) of one container: its limits, else
/// its requests (an extended resource's request, if given, must equal its limit).
fn container_gpus(c: &Container) -> Result<BTreeMap<String, u64>, Uncountable> {
    let mut out = BTreeMap::new();
    let Some(resources) = &c.resources else {
        return Ok(out);
    };
    for map in [&resources.limits, &resources.requests]
        .into_iter()
        .flatten()
    {
        for (name, quantity) in map {
            if name != GPU_RESOURCE && !name.starts_with(MIG_RESOURCE_PREFIX) {
                continue;
            }
            if out.contains_key(name) {
                continue; // the limit was read first
            }
            let count = whole_quantity(&quantity.0).ok_or_else(|| {
                Uncountable(format!(
                    "container {:?} asks for {name}: {:?}, which is not a whole number of devices",
                    c.name, quantity.0
                ))
            })?;
            out.insert(name.clone(), count);
        }
    }
    Ok(out)
}

fn add(into: &mut BTreeMap<String, u64>, from: &BTreeMap<String, u64>) {
    for (k, v) in from {
        let e = into.entry(k.clone()).or_default();
        *e = e.saturating_add(*v);
    }
}

/// The GPUs `spec` asks for, as the scheduler counts a pod's resources: the containers' sum
/// (with the sidecars, init containers with `restartPolicy: Always`, which run beside them),
/// or the largest ask of a regular init container (with the sidecars started before it),
/// whichever is larger. A pod asking for two kinds of GPU resources (whole GPUs and a MIG
/// profile, or two profiles) is [`Uncountable`]: one lease holds one model.
pub fn gpu_ask(spec: &PodSpec) -> Result<GpuAsk, Uncountable> {
    let mut running = BTreeMap::new();
    let mut init_peak: BTreeMap<String, u64> = BTreeMap::new();
    let mut sidecars = BTreeMap::new();
    for c in spec.init_containers.iter().flatten() {
        let gpus = container_gpus(c)?;
        if c.restart_policy.as_deref() == Some("Always") {
            add(&mut sidecars, &gpus);
        } else {
            let mut during = sidecars.clone();
            add(&mut during, &gpus);
            for (k, v) in during {
                let e = init_peak.entry(k).or_default();
                *e = (*e).max(v);
            }
        }
    }
    for c in &spec.containers {
        add(&mut running, &container_gpus(c)?);
    }
    add(&mut running, &sidecars);
    let mut total = running;
    for (k, v) in init_peak {
        let e = total.entry(k).or_default();
        *e = (*e).max(v);
    }
    total.retain(|_, v| *v > 0);
    match total.len() {
        0 => Ok(GpuAsk::default()),
        1 => {
            let (resource, count) = total.into_iter().next().expect("one entry");
            Ok(GpuAsk { count, resource })
        }
        _ => Err(Uncountable(format!(
            "the pod asks for {}: a pod gpuwarden admits holds one kind of GPU",
            total
                .iter()
                .map(|(k, v)| format!("{v} x {k}"))
                .collect::<Vec<_>>()
                .join(" and ")
        ))),
    }
}

/// The model label value `spec` pins: its `nodeSelector`'s, or the single value every term of
/// its required node affinity gives the label with `In`. None when it leaves the model open.
pub fn model_label_value(spec: &PodSpec, label: &str) -> Option<String> {
    if let Some(value) = spec.node_selector.as_ref().and_then(|s| s.get(label)) {
        return Some(value.clone());
    }
    let terms = &spec
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms;
    let mut found: Option<&String> = None;
    for term in terms {
        let value = term.match_expressions.iter().flatten().find_map(|e| {
            match (e.key == label, e.operator.as_str(), e.values.as_deref()) {
                (true, "In", Some([one])) => Some(one),
                _ => None,
            }
        })?;
        match found {
            Some(f) if f != value => return None,
            _ => found = Some(value),
        }
    }
    found.cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> PodSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn containers_add_up_and_init_containers_take_the_larger() {
        let s = spec(serde_json::json!({
            "initContainers": [
                {"name": "fetch", "resources": {"limits": {"nvidia.com/gpu": "3"}}},
                {"name": "proxy", "restartPolicy": "Always", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
            "containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "500m"}}},
                {"name": "b", "resources": {"requests": {"nvidia.com/gpu": "1"}}},
                {"name": "c"}
            ]
        }));
        // Running: 2 + 1 + the sidecar's 1 = 4; the init container needs 3 (before the sidecar).
        assert_eq!(
            gpu_ask(&s).unwrap(),
            GpuAsk {
                count: 4,
                resource: GPU_RESOURCE.into()
            }
        );
        let s = spec(serde_json::json!({
            "initContainers": [{"name": "warm", "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
            "containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]
        }));
        assert_eq!(gpu_ask(&s).unwrap().count, 8);
    }

    #[test]
    fn pods_without_gpus_ask_for_none_and_odd_asks_are_named() {
        let s = spec(
            serde_json::json!({"containers": [{"name": "web", "resources": {"limits": {"cpu": "1"}}}]}),
        );
        assert_eq!(gpu_ask(&s).unwrap().count, 0);
        let s = spec(
            serde_json::json!({"containers": [{"name": "x", "resources": {"limits": {"nvidia.com/gpu": "500m"}}}]}),
        );
        assert!(gpu_ask(&s).unwrap_err().0.contains("not a whole number"));
        let s = spec(serde_json::json!({"containers": [
            {"name": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            {"name": "y", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}
        ]}));
        assert!(gpu_ask(&s).unwrap_err().0.contains("one kind of GPU"));
        let s = spec(
            serde_json::json!({"containers": [{"name": "y", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "2"}}}]}),
        );
        let ask = gpu_ask(&s).unwrap();
        assert_eq!((ask.count, ask.mig_profile()), (2, Some("1g.10gb")));
    }

    #[test]
    fn the_model_comes_from_the_node_selector_or_a_single_affinity_value() {
        let label = "nvidia.com/gpu.product";
        let s = spec(
            serde_json::json!({"containers": [], "nodeSelector": {label: "NVIDIA-H100-80GB-HBM3"}}),
        );
        assert_eq!(
            model_label_value(&s, label).as_deref(),
            Some("NVIDIA-H100-80GB-HBM3")
        );
        let affinity = |values: serde_json::Value| {
            spec(
                serde_json::json!({"containers": [], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": label, "operator": "In", "values": values}]}
                ]}}}}),
            )
        };
        assert_eq!(
            model_label_value(&affinity(serde_json::json!(["A100"])), label).as_deref(),
            Some("A100")
        );
        assert_eq!(
            model_label_value(&affinity(serde_json::json!(["A100", "H100"])), label),
            None
        );
        assert_eq!(
            model_label_value(&spec(serde_json::json!({"containers": []})), label),
            None
        );
    }
}
